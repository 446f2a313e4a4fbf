"""On-policy distillation (OPD): its config, `loss.opd`, and which teacher scores a sample.

A teacher model, served by an engine of its own (`verst serve --model DIR`, or any SGLang
server), scores the tokens the student sampled by prefill (`verst.rollout.teacher`); the
trainer then moves every token's advantage by −coef·(student log-prob − teacher log-prob)
after the estimator has made its advantages and before any whitening
(`verst.train.advantages.opd_advantages`). With `rollout.reward: none` that is pure
distillation; with a reward it is distillation and RL at once.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from verst.configbase import ConfigBase
from verst.types import Sample

DEFAULT_TEACHER = "default"
TEACHER_KEY = "opd_teacher"  # the sample metadata (a data column) that names its teacher


class OPDConfig(ConfigBase):
    coef: float = Field(
        1.0, ge=0, description="weight c of the per-token advantage update A -= c*(logp_s - logp_t)"
    )
    teacher_urls: dict[str, str] = Field(
        default_factory=dict,
        description="teacher engines by name (verst serve or SGLang base URLs); a sample's "
        "metadata.opd_teacher picks one, else the one named 'default'",
    )
    timeout_s: float = Field(
        120.0, gt=0, description="most seconds one teacher scoring request may take"
    )

    @model_validator(mode="after")  # after, not a field validator: it must see the default too
    def _some_teacher(self) -> OPDConfig:
        value = self.teacher_urls
        if not value:
            raise ValueError(
                "loss.opd.teacher_urls: name at least one teacher, e.g. "
                "{default: http://127.0.0.1:30000}"
            )
        for name, url in value.items():
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"loss.opd.teacher_urls.{name}: {url!r} is not an http(s) URL")
        return self


def teacher_name(sample: Sample, teachers: dict[str, str]) -> str:
    """The teacher that scores `sample`: its `metadata.opd_teacher`, else 'default'; a
    ValueError naming the sample's prompt when that teacher is not in `teachers`."""
    name = sample.metadata.get(TEACHER_KEY)
    if name is None:
        if DEFAULT_TEACHER in teachers:
            return DEFAULT_TEACHER
        raise ValueError(
            f"sample of prompt {sample.prompt_id} names no teacher (metadata.{TEACHER_KEY}) and "
            f"loss.opd.teacher_urls has no '{DEFAULT_TEACHER}' teacher: known teachers are "
            f"{', '.join(sorted(teachers))}"
        )
    if name not in teachers:
        raise ValueError(
            f"sample of prompt {sample.prompt_id}: metadata.{TEACHER_KEY}={name!r} is not in "
            f"loss.opd.teacher_urls (known teachers: {', '.join(sorted(teachers))})"
        )
    return str(name)
