"""The GPUs `hydra/launcher=slurm` asks for (`${slurm_gpus:...}`): none for accelerator=cpu (a CPU-only cluster refuses
`--gpus-per-node`), and for accelerator=auto none where `sinfo` says the partition has none."""

import subprocess

from omegaconf import OmegaConf


def slurm_output(*command: str) -> str | None:
    """What a SLURM command prints; None where it cannot tell (no such command, an error, no answer in a minute)."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def gpus_per_node(accelerator: str, devices: int, partition: str | None = None) -> int | None:
    """`--gpus-per-node` for a job of `devices` processes per node (`partition` None: the default one); None leaves
    the option out. Without sinfo or such a partition it asks for them, and sbatch says what is wrong."""
    if accelerator == "cpu":
        return None
    if accelerator == "auto":
        listing = slurm_output("sinfo", "--noheader", "--format=%P|%G") or ""
        rows = [line.strip().partition("|") for line in listing.splitlines()]
        gres = [node_gres for name, _, node_gres in rows
                if (partition is None and name.endswith("*")) or name.rstrip("*") == partition]
        if gres and not any("gpu" in g for g in gres):
            return None
    return devices


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("slurm_gpus"):
        OmegaConf.register_new_resolver("slurm_gpus", gpus_per_node, use_cache=True)
