"""The Docker files, checked without a Docker engine: they parse, and they agree with pyproject.toml, constraints.txt and the config."""

import json
import re
import tomllib
from pathlib import Path, PurePosixPath

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.helpers import REPO

DOCKER = REPO / "docker"
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([A-Za-z0-9][A-Za-z0-9.+!_-]*)")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    result, pending = [], ""
    for line in dockerfile.read_text().splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not pending):
            continue
        if stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        result.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return result


def pins(path: Path) -> dict[str, str]:
    """name -> version of every `name==version` line of a constraints file."""
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return {name.lower(): version for name, version in (PIN.fullmatch(line).groups() for line in lines if line)}


def requirements() -> dict[str, SpecifierSet]:
    """name -> the versions pyproject.toml allows, extras included."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [s for extra in project["optional-dependencies"].values() for s in extra]
    return {(r := Requirement(s)).name.lower(): r.specifier for s in specs}


@pytest.mark.parametrize("constraints", ["constraints.txt", ".ci/oldest.txt"])
def test_each_known_good_set_pins_every_dependency_within_its_range(constraints):
    pinned, allowed = pins(REPO / constraints), requirements()
    assert pinned.keys() == allowed.keys()
    for name, version in pinned.items():
        assert allowed[name].contains(version), f"{constraints}: {name}=={version} is outside pyproject.toml's {allowed[name]}"


def test_ci_and_the_docker_image_install_the_known_good_set(steps):
    assert "-c constraints.txt" in (REPO / ".ci" / "run").read_text()
    assert any(k == "RUN" and re.search(r"pip install -c constraints\.txt \.(\s|$)", a) for k, a in steps)


@pytest.fixture(scope="module")
def steps() -> list[tuple[str, str]]:
    return instructions(DOCKER / "Dockerfile")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def base_image(steps: list[tuple[str, str]]) -> str:
    """The FROM image, with `${ARG}` replaced by the ARG's default."""
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    image = next(a for k, a in steps if k == "FROM").split()[0]
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], image)


def test_dockerfile_starts_from_a_cuda_or_pytorch_runtime_image(steps):
    image = base_image(steps)
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+(\.\d+)?-(cudnn\d*-)?runtime-ubuntu\d+\.\d+", image) or re.fullmatch(
        r"pytorch/pytorch:[\w.+-]*runtime", image
    ), image


def test_base_image_cuda_release_matches_the_installed_torch_wheel(steps):
    image = base_image(steps)
    if torch.version.cuda is None or not image.startswith("nvidia/cuda:"):
        pytest.skip("the local torch is a CPU build, or the base is not nvidia/cuda")
    base_cuda = image.split(":")[1].split("-")[0]
    assert base_cuda.split(".")[:2] == torch.version.cuda.split(".")[:2], (base_cuda, torch.version.cuda)


def test_entrypoint_is_the_training_module(steps):
    entrypoints = [json.loads(a) for k, a in steps if k == "ENTRYPOINT"]
    assert entrypoints[-1:] == [["python", "-m", "src.train"]]


def test_dependencies_are_installed_from_the_copied_pyproject(steps):
    copy_pyproject = next(i for i, (k, a) in enumerate(steps) if k == "COPY" and "pyproject.toml" in a.split()[:-1])
    install = next(i for i, (k, a) in enumerate(steps) if k == "RUN" and re.search(r"pip install (\S+ )*\.(\s|$)", a))
    copy_code = next(i for i, (k, a) in enumerate(steps) if k == "COPY" and a.split()[0] == "src")
    assert copy_pyproject < install < copy_code  # code edits keep the installed layer


def test_every_copy_source_exists_and_is_not_ignored(steps):
    ignore = [line for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    sources = [s for k, a in steps if k == "COPY" for s in a.split()[:-1] if not s.startswith("--")]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), source
        assert "*" not in ignore or source.rstrip("/") in kept, f"{source} is excluded by the .dockerignore"


def test_no_pin_in_the_docker_files_differs_from_the_known_good_set():
    known = pins(REPO / "constraints.txt")
    files = [*DOCKER.iterdir(), REPO / "docs" / "docker.md"]
    for path in files:
        for name, version in PIN.findall(path.read_text()):
            assert name.lower() in known, f"{path.name} pins {name}, which constraints.txt does not"
            assert version == known[name.lower()], f"{path.name}: {name}=={version}, constraints.txt has {known[name.lower()]}"


def _mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path (resolved from docker/, with ${VAR:-default} taking the default)."""
    result = {}
    for volume in service["volumes"]:
        host, container = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", volume).split(":")[:2]
        result[container] = (DOCKER / host).resolve()
    return result


def test_compose_has_train_with_gpus_and_tensorboard_on_6006(compose):
    services = compose["services"]
    assert {"train", "tensorboard"} <= set(services)
    train, board = services["train"], services["tensorboard"]
    for service in (train, board):
        context = (DOCKER / service["build"]["context"]).resolve()
        assert context == REPO and (context / service["build"]["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    gpus = train["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in gpus)
    assert any(str(p).split(":")[-1] == "6006" for p in board["ports"])
    command = board["entrypoint"]
    assert command[0] == "tensorboard" and command[command.index("--port") + 1] == "6006"
    logdir = command[command.index("--logdir") + 1]
    assert _mounts(board)[logdir] == REPO / "outputs"


def test_compose_mounts_where_the_config_writes_runs_and_reads_data(compose, steps):
    workdir = PurePosixPath(next(a for k, a in steps if k == "WORKDIR"))
    mounts = _mounts(compose["services"]["train"])
    run_dir = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "hydra" / "default.yaml"))["run"]["dir"]
    run_dir = run_dir.removeprefix("${claim_dir:")  # the folder name inside the resolver that claims it
    data_root = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "data" / "fashion_mnist.yaml"))["root"]
    outputs = str(workdir / PurePosixPath(run_dir).parts[0])
    assert mounts[outputs] == REPO / "outputs"
    assert str(workdir / data_root) in mounts
