"""The base class of every config section: typed, strict, and documented field by field.

Each part owns its section beside its code (for example `verst/train/trainer.py` holds
`TrainerConfig`); `verst/config.py` only composes them. Every field needs a default and a
one-line `description`, which `verst train --help` prints.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigBase(BaseModel):
    """Unknown keys are errors, assignments are validated, and nothing heavy is stored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    def changed_fields(self) -> list[str]:
        """The names of the fields whose value differs from the section's defaults."""
        default = type(self)()
        return [
            name
            for name in type(self).model_fields
            if getattr(self, name) != getattr(default, name)
        ]
