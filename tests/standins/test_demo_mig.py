"""``vramshare demo --mig`` (issue 24): a pod gets a MIG partition made for it, end to end.

The real extender plans, the stand-in kubelet allocates the steered device over gRPC, the real device
plugin makes the instance on the simulated MIG GPU, and a deleted pod's instance is destroyed.
"""
from __future__ import annotations

import argparse
import io

import pytest

from standins import demo_mig
from vramshare.errors import UsageError
from vramshare_cli import main as cli


def test_the_demo_makes_adopts_refuses_and_reaps():
    out = io.StringIO()
    assert demo_mig.run(argparse.Namespace(pods=None, verbose=False), out) == 0
    text = out.getvalue()
    assert "instances now: 3g.40gb@0 (the admin's)" in text
    # the fragmentation term puts the 1g at slot 6, which keeps the 2g.20gb at slot 4 creatable
    assert "1g.10gb at memory slot 6" in text and "partition made for it: instances now 3g.40gb@0+1g.10gb@6" in text
    assert "partition adopted (it existed)" in text
    assert "instances now 3g.40gb@0+2g.20gb@4+1g.10gb@6" in text
    assert "NVIDIA_VISIBLE_DEVICES=MIG-" in text and "VRAMSHARE_MEMORY_LIMIT_MIB=20480" in text
    assert "qwen2-14b" in text and "stays Pending" in text
    assert "MIG instances created: 2, adopted: 1" in text
    assert "70.0 of 80.0 GiB used, 10.0 GiB free" in text  # /inspect counts the GPU once, booked partitions
    assert "mig:2g.20gb  20.0   20.0  0.0   inference/bge-embedder" in text
    assert text.rstrip().endswith("4 of 6 pods got a MIG partition.")
    assert "is destroyed" in text and "instances now 3g.40gb@0+2g.20gb@4\n" in text
    # issue 24, isolation: mig: a 6 GiB gpu-memory ask gets a 1g.10gb made for it where the deleted pod's was
    iso = text[text.index("* phi3-mini-iso"):]
    assert "asks vramshare.io/gpu-memory: 6 with vramshare.io/isolation: mig" in iso
    assert "1g.10gb at memory slot 6" in iso and "VRAMSHARE_MEMORY_LIMIT_MIB=10240" in iso
    assert "partition made for it: instances now 3g.40gb@0+2g.20gb@4+1g.10gb@6" in iso
    assert "recorded: allocated, holds GPU-8192a3b4-c5d6-47e8-b9fa-0b1c2d3e4f67::mig-1g.10gb@6" in iso
    # the same ask without the annotation never lands on the MIG GPU's memory
    plain = text[text.index("* phi3-mini-shared"):]
    assert "stays Pending: node has no GPU in shared mode" in plain


def test_mig_is_its_own_demo():
    args = cli.build_parser().parse_args(["demo", "--mig", "--dra"])
    with pytest.raises(UsageError, match="--mig is its own demo"):
        cli.refuse_flags_that_do_not_apply(args)
