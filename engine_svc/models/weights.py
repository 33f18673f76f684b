"""SafetensorsWeights: the tensors of an HF folder, one safetensors file or several (sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine_svc.models.spec import ModelConfigError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class SafetensorsWeights:
    """Owns the map tensor name -> file and the open file handles; reads one tensor at a time.

    Every error names the folder, the file and the tensor, so a broken checkpoint is found at
    start-up.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._handles: dict[Path, object] = {}
        self._where: dict[str, Path] = {}
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            self._read_index(index)
        else:
            files = [self.model_dir / SINGLE_FILE] if (self.model_dir / SINGLE_FILE).is_file() else sorted(
                self.model_dir.glob("*.safetensors")
            )
            if not files:
                raise ModelConfigError(f"{self.model_dir}: no {SINGLE_FILE} (nor {INDEX_FILE}) found")
            for file in files:
                for name in self._open(file).keys():
                    self._where[name] = file

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelConfigError(f"{index}: malformed index ({exc!r}); expected a 'weight_map' object") from exc
        if not isinstance(weight_map, dict):
            raise ModelConfigError(f"{index}: 'weight_map' must map tensor names to file names")
        for name, file_name in weight_map.items():
            file = self.model_dir / str(file_name)
            if not file.is_file():
                raise ModelConfigError(f"{file}: weight file listed in {index.name} not found (tensor {name!r})")
            self._where[name] = file

    def _open(self, file: Path):
        handle = self._handles.get(file)
        if handle is None:
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for a corrupt header
                raise ModelConfigError(f"{file}: cannot read safetensors file ({exc})") from exc
            self._handles[file] = handle
        return handle

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name`, checked against `shape`."""
        file = self._where.get(name)
        if file is None:
            raise ModelConfigError(f"{self.model_dir}: tensor {name!r} is missing from the weight files")
        try:
            tensor = self._open(file).get_tensor(name)
        except ModelConfigError:
            raise
        except Exception as exc:
            raise ModelConfigError(f"{file}: cannot read tensor {name!r} ({exc})") from exc
        if tuple(tensor.shape) != tuple(shape):
            raise ModelConfigError(
                f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies {tuple(shape)}"
            )
        return tensor
