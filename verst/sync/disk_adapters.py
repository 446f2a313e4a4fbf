"""The disk transport's LoRA half: each adapter update is written as a peft directory
(`adapter_config.json`, `adapter_model.safetensors`) that every engine loads with SGLang's
`/load_lora_adapter`, under `<root>/adapters/<name>/weight_v<version>`. A directory appears
whole (written under a temporary name, then renamed), and older versions of the adapter are
deleted once a newer one is written.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from safetensors.torch import save_file

from verst.models.lora import ADAPTER_WEIGHTS_FILE, PEFT_PREFIX, peft_config_of
from verst.plugins import AdapterUpdate
from verst.sync.disk_format import TMP_PREFIX


class AdapterPublisher:
    def __init__(self, root: Path) -> None:
        self.root = root / "adapters"

    def path(self, name: str, version: int) -> Path:
        return self.root / name / f"weight_v{version}"

    def publish(self, adapter: AdapterUpdate, version: int) -> Path:
        """Write `adapter` as `version` (again only if it is not there yet) and drop older
        versions of it."""
        final = self.path(adapter.name, version)
        if final.is_dir():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.parent / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        tensors = {
            # cloned: the tensors may be views of one buffer, which safetensors refuses
            PEFT_PREFIX + name: t.detach().cpu().clone()
            for name, t in adapter.tensors()
        }
        save_file(tensors, staging / ADAPTER_WEIGHTS_FILE, metadata={"format": "pt"})
        peft_config_of(adapter.config).save_pretrained(str(staging))
        os.rename(staging, final)
        for old in final.parent.iterdir():
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final
