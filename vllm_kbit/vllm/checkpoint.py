"""Where a checkpoint's tensors live, for load errors that name the file: :class:`CheckpointFiles`.

vLLM hands the quantization config the model's path (``QuantizationConfig.maybe_update_config``) before any
weight is loaded. For a local checkpoint directory :meth:`CheckpointFiles.check_shards` then opens every
safetensors shard's header (no tensor data is read), so a truncated or unreadable shard fails the load in one
line naming the file instead of deep in vLLM's weight iterator. The map tensor name -> file is read only when
an error message needs it (``model.safetensors.index.json``, or the headers of the directory's shards).
"""

from __future__ import annotations

import json
import os
import re

# A routed expert's packed weight: <block>.experts.<e>.<projection>.qweight (settings._EXPERT_TENSOR's names).
_EXPERT_QWEIGHT = re.compile(r"\.experts\.\d+\.[^.]+\.qweight$")

INDEX_NAME = "model.safetensors.index.json"


class CheckpointFiles:
    """The safetensors files of the checkpoint directory ``model_dir`` (None: unknown, e.g. a hub id)."""

    def __init__(self, model_dir: str | None = None) -> None:
        self.model_dir = model_dir if model_dir and os.path.isdir(model_dir) else None
        self._weight_map: dict[str, str] | None = None

    def shard_files(self) -> list[str]:
        """The shards vLLM loads: those the index lists (present ones), else every top-level *.safetensors."""
        if self.model_dir is None:
            return []
        index = os.path.join(self.model_dir, INDEX_NAME)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    files = set(json.load(f)["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                files = set()  # vLLM reports a broken index itself
            return sorted(f for f in files if os.path.isfile(os.path.join(self.model_dir, f)))
        return sorted(f for f in os.listdir(self.model_dir) if f.endswith(".safetensors"))

    def _keys(self, file: str) -> list[str]:
        """Tensor names in one shard; raises a one-line ValueError naming the file if it cannot be read."""
        from safetensors import SafetensorError, safe_open

        path = os.path.join(self.model_dir, file)
        try:
            # safe_open parses the header and checks that its tensors exactly cover the file (a truncated
            # shard fails here); tensor data is memory-mapped, not read.
            with safe_open(path, framework="pt") as f:
                return list(f.keys())
        except (SafetensorError, OSError) as e:
            raise ValueError(
                f"kbit: checkpoint shard {path} ({os.path.getsize(path) if os.path.exists(path) else 0} bytes) "
                f"cannot be read: {e}; expected a complete safetensors file (truncated or corrupted download?)"
            ) from None

    def check_shards(self) -> None:
        """Opens every shard's header; fails on the first unreadable one, naming it."""
        for file in self.shard_files():
            self._keys(file)

    def check_expert_qweights_2d(self, vllm_version: str) -> None:
        """Refuses routed-expert qweights stored 3-D, ``[N, K/32, k]`` (``vllm-kbit convert`` before routed experts
        were written 2-D), which vLLM before 0.32 takes for stacks of all experts; headers only."""
        from safetensors import safe_open

        for file in self.shard_files():
            self._keys(file)  # a readable shard, or the one-line error
            with safe_open(os.path.join(self.model_dir, file), framework="pt") as f:
                for key in f.keys():
                    if _EXPERT_QWEIGHT.search(key) and len(f.get_slice(key).get_shape()) == 3:
                        raise ValueError(
                            f"kbit: checkpoint tensor {key} in {file} stores a routed expert 3-D ([N, K/32, k], written "
                            f"by an older vllm-kbit convert), which vLLM {vllm_version} cannot load (vLLM 0.32 and later "
                            f"can); rewrite the checkpoint with `vllm-kbit upgrade {self.model_dir} NEW_DIR` (a reshape, no "
                            "requantization) or serve it with vLLM >= 0.32"
                        )

    def file_of(self, tensor: str) -> str | None:
        """The shard file holding ``tensor``, or None when unknown. A vLLM name whose prefix the model remapped
        (``model.`` -> ``model.language_model.``) is matched by a unique tail that keeps its layer and expert
        numbers, so a missing tensor is never matched to another layer's."""
        if self.model_dir is None:
            return None
        if self._weight_map is None:
            self._weight_map = {}
            index = os.path.join(self.model_dir, INDEX_NAME)
            try:
                with open(index) as f:
                    self._weight_map = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError):
                for file in self.shard_files():
                    try:
                        self._weight_map.update(dict.fromkeys(self._keys(file), file))
                    except ValueError:
                        pass
        if tensor in self._weight_map:
            return self._weight_map[tensor]
        parts = tensor.split(".")
        first_number = next((i for i, p in enumerate(parts) if p.isdigit()), 0)
        for i in range(1, first_number + 1):
            tail = "." + ".".join(parts[i:])
            hits = {f for k, f in self._weight_map.items() if k.endswith(tail) or k == tail[1:]}
            if hits:
                return hits.pop() if len(hits) == 1 else None
        return None

    def where(self, tensor: str) -> str:
        """``tensor`` followed by ``in <file>`` when the file is known: the subject of a load error."""
        file = self.file_of(tensor)
        return f"{tensor} in {file}" if file else tensor
