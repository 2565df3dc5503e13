"""What `VLLMEngine` adds to vLLM's worker class (`worker_extension_cls`), to load only the
tensors that changed: it runs inside vLLM's worker processes, called by name through
`AsyncLLM.collective_rpc`, so no code travels pickled between the processes.

`load_changed_tensors` reads the changed tensors, widened to whole layers (`whole_layers`: vLLM
fuses q/k/v into qkv_proj, gate/up into gate_up_proj, and processes a layer, e.g. repacks it for
the CPU's GEMM kernels, once all of it is loaded), and hands them to the worker's own in-place
`reload_weights` with that iterator: the model's `load_weights` maps them onto its parameters
and every layer it does not touch keeps its tensors as they are.
"""

import logging
from pathlib import Path

from services.rollout.engines.tensors import read_tensors, tensor_files, whole_layers

# vLLM warns once per layer that a reload leaves untouched, and lists every parameter not
# loaded: here that is the point, so those two loggers are quiet during the load.
RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


class ChangedTensorsLoader:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def load_changed_tensors(self, folder: str, changed: list[str]) -> int:
        """Load `changed` (checkpoint names) from `folder` in place; the number of tensors
        read. Every name is checked against the folder before the model is touched."""
        path = Path(folder)
        names = whole_layers(changed, tensor_files(path))
        tensors = read_tensors(path, names)  # raises here on a name the folder lacks
        loggers = [logging.getLogger(name) for name in RELOAD_LOGGERS]
        levels = [lg.level for lg in loggers]
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            self.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=tensors, is_checkpoint_format=True
            )
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)
        return len(names)
