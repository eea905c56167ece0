import os
import socket
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

EUROSAT = os.path.join(ROOT, "..", "shared", "data", "EuroSAT.zip")
PER_CLASS = 20  # small_data: 200 real images, 160 train, 40 test


@pytest.fixture(scope="session")
def eurosat_zip():
    """The real EuroSAT archive in ../shared/data (its absence fails under CI=true)."""
    if not os.path.isfile(EUROSAT):
        msg = f"the real EuroSAT archive is missing at {os.path.abspath(EUROSAT)}"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + " (CI must have ../shared/data beside the checkout)")
        pytest.skip(msg)
    return EUROSAT


EUROSAT_MS = os.path.join(ROOT, "..", "shared", "data", "EuroSAT_MS_sample.zip")


@pytest.fixture(scope="session")
def eurosat_ms_zip():
    """The sample of real EuroSAT MS GeoTIFFs in ../shared/data (its absence fails under CI=true)."""
    if not os.path.isfile(EUROSAT_MS):
        msg = f"the EuroSAT MS sample is missing at {os.path.abspath(EUROSAT_MS)}"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + " (CI must have ../shared/data beside the checkout)")
        pytest.skip(msg)
    return EUROSAT_MS


def prep(src, out, *extra):
    """prepare_data.py's main on `src` with one worker."""
    import prepare_data
    args = prepare_data.get_args_parser().parse_args(
        ["--source", str(src), "--out", str(out), "--workers", "1", *extra])
    return prepare_data.main(args)


@pytest.fixture(scope="session")
def small_data(eurosat_zip, tmp_path_factory):
    """A prepared folder of PER_CLASS real EuroSAT images per class."""
    out = tmp_path_factory.mktemp("eurosat") / "data"
    prep(eurosat_zip, out, "--per-class", str(PER_CLASS))
    return out


def gen(seed):
    """A seeded generator: each test's random inputs are its own and repeat."""
    return torch.Generator().manual_seed(seed)


def clusters(n_per, centres, noise, seed):
    """n_per points around each of the C centres (C, D) and their labels: toy kNN data."""
    C, D = centres.shape
    y = torch.arange(C).repeat_interleave(n_per)
    return centres[y] + noise * torch.randn(C * n_per, D, generator=gen(seed)), y


def free_port():
    """A TCP port on the loopback that is free now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
