"""What `hydra/launcher=slurm` asks SLURM for: GPUs only where the run uses them.

`${slurm_gpus:${accelerator},${devices},${hydra.launcher.partition}}` in conf/hydra/launcher/slurm.yaml:
- accelerator=gpu: `devices` GPUs per node (one per DDP process);
- accelerator=cpu: no GPU request (a CPU-only cluster refuses `--gpus-per-node`: "Invalid generic resource");
- accelerator=auto: GPUs when the partition's nodes have any, as `sinfo` reports their GRES; `devices`
  GPUs when sinfo cannot tell (no SLURM client here), as a GPU cluster needs.
"""

import subprocess

from omegaconf import OmegaConf


def partition_has_gpus(partition: str | None) -> bool | None:
    """Whether a node of `partition` (None: the default partition) has GPUs; None when sinfo cannot tell."""
    try:
        listing = subprocess.run(["sinfo", "--noheader", "--format=%P|%G"], capture_output=True, text=True,
                                 timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gres = []
    for line in listing.splitlines():
        name, _, node_gres = line.strip().partition("|")
        is_default = name.endswith("*")
        if (partition is None and is_default) or name.rstrip("*") == partition:
            gres.append(node_gres)
    if not gres:
        return None  # no such partition: sbatch will say so
    return any("gpu" in g for g in gres)


def gpus_per_node(accelerator: str, devices: int, partition: str | None = None) -> int | None:
    """`--gpus-per-node` for a job of `devices` processes per node; None leaves the option out."""
    if accelerator == "cpu":
        return None
    if accelerator == "auto" and partition_has_gpus(partition) is False:
        return None
    return devices


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("slurm_gpus"):
        OmegaConf.register_new_resolver("slurm_gpus", gpus_per_node, use_cache=True)
