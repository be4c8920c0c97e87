"""Runs a script (gndpo_minimal.py, a test worker) with FSDP on CPU processes, for the tests and bench/memory.py:
`accelerate launch --config_file <FSDP config with use_cpu: true> bench/fsdp_cpu_launch.py SCRIPT ARGS...`.

Accelerate turns ACCELERATE_USE_FSDP into FSDP only for GPU-like process groups; with CPU processes it keeps
MULTI_CPU (DDP), and gndpo_minimal.py refuses that launch. PyTorch's FSDP2 itself runs on CPU over gloo, so this
wrapper gives the Accelerate state the FSDP type and the plugin it built from the config, the one thing Accelerate
skips on CPU, and leaves everything else to Accelerate: fully_shard in prepare(), sharded save_state/load_state,
get_state_dict's gather. What it cannot stand in for is NCCL and bf16 mixed precision on GPUs.
"""

import os
import runpy
import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

# An Accelerate FSDP2 config for 2 CPU processes (gloo), float32: the student's blocks in units of their own, gathered
# for a forward and freed after it (tests/test_fsdp.py and bench/memory.py write it next to their runs)
CPU_FSDP2_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 2
mixed_precision: 'no'
use_cpu: true
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_offload_params: false
  fsdp_cpu_ram_efficient_loading: false
  fsdp_activation_checkpointing: false
rdzv_backend: static
same_network: true
debug: false
"""
_init = AcceleratorState.__init__


def _init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP


if __name__ == "__main__":
    AcceleratorState.__init__ = _init_with_fsdp_on_cpu
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python SCRIPT` would have it
    runpy.run_path(sys.argv[0], run_name="__main__")
