"""Repository basics (issue 22): the license pyproject declares is there, the changelog has the current
version, the package, image and manifests name one version, README's Kubernetes versions are those
the manifests need, and nothing shipped cites a file the repository does not have."""
from __future__ import annotations

import argparse
import hashlib
import pathlib
import re
import tomllib

import yaml

from vramshare import __version__
from vramshare_cli import install

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
APACHE_2_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"  # https://www.apache.org/licenses/LICENSE-2.0.txt


def test_the_license_pyproject_declares_is_the_license_file():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == {"text": "Apache-2.0"}
    assert hashlib.md5((ROOT / "LICENSE").read_bytes()).hexdigest() == APACHE_2_MD5  # noqa: S324 - a fingerprint


def test_one_version_for_package_image_manifests_and_changelog():
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == __version__
    images = set()
    for path in (ROOT / "deploy").rglob("*.yaml"):
        images |= set(re.findall(rf"{re.escape(install.IMAGE_NAME)}:([\w.-]+)", path.read_text(encoding="utf-8")))
    assert images == {__version__}
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## [{__version__}]" in changelog and "## Version policy" in changelog and "## Upgrading" in changelog


def _minor(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def test_readme_versions_are_what_the_manifests_need():
    lo, claim, dra = (f"{v[0]}.{v[1]}" for v in (install.MIN_KUBERNETES, install.NODE_CLAIM_KUBERNETES,
                                                  install.DRA_KUBERNETES))
    assert f"Kubernetes {lo} or newer" in README
    assert f"{claim} for the node-scoped device" in README and f"(Kubernetes {claim};" in README
    rows = dict(re.findall(r"^\| (1\.\d+ (?:to 1\.\d+|and newer)) \| ([^|]+)\|", README, re.M))
    assert rows, "README's table of cluster versions and paths"
    for span, path in rows.items():
        first = _minor(span.split()[0])
        if "deploy/daemonset/dra/" in path:
            assert first == install.DRA_KUBERNETES
        else:
            last = install.DRA_KUBERNETES[1] - 1  # the device-plugin row ends where the DRA row starts
            assert first == install.MIN_KUBERNETES and span.endswith(f"to 1.{last}"), span
    mentioned = {_minor(v) for v in re.findall(r"(?<![\d.])(1\.\d\d)(?![\d.])", README)
                 if re.search(rf"Kubernetes {re.escape(v)}|{re.escape(v)} (?:to|or newer|and newer|\+)", README)}
    assert all(v >= install.MIN_KUBERNETES for v in mentioned), f"README names an unsupported version: {mentioned}"


def test_the_admission_policies_need_what_readme_says():
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/daemonset/admission-policies.yaml").read_text()) if d]
    # ValidatingAdmissionPolicy is admissionregistration.k8s.io/v1 from 1.30 (GA), the oldest we support
    assert {d["apiVersion"] for d in docs} == {"admissionregistration.k8s.io/v1"}
    assert install.MIN_KUBERNETES == (1, 30)


def test_nothing_in_deploy_cites_a_missing_file():
    for path in (ROOT / "deploy").rglob("*"):
        if path.is_file() and path.suffix in {".yaml", ".sh", ".md"}:
            for name in re.findall(r"\b([\w./-]+\.md)\b", path.read_text(encoding="utf-8")):
                hits = [p for p in ROOT.rglob(pathlib.Path(name).name) if ".git" not in p.parts]
                assert hits, f"{path.relative_to(ROOT)} cites {name}, which is not in the repository"


def _readme_synopsis() -> dict[str, str]:
    """README's "The command line" block: subcommand (or '' for the global options) -> its lines."""
    [block] = re.findall(r"^## The command line\n\n```\n(.*?)```", README, re.S | re.M)
    out: dict[str, str] = {}
    command = None
    for line in block.splitlines():
        head = re.match(r"vramshare(?: ([a-z-]+))?\s", line + " ")
        if head:
            command = head.group(1) if head.group(1) and not line.startswith("vramshare [") else ""
        assert command is not None, line
        out[command] = out.get(command, "") + " " + line
    return out


def test_readme_command_line_names_every_flag_of_every_subcommand_and_no_other():
    """The synopsis is what an admin reads instead of ``--help``: on main it lacked ``--leader-elect``
    (which the shipped extender Deployment runs with), ``--enforcement``, ``--cert-days``, ``--mig``,
    ``--service``, ``--quota-dir`` and others; a flag it names must exist, with the same choices."""
    from vramshare_cli.main import build_parser

    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    said = _readme_synopsis()
    commands = {"": parser, **sub.choices}
    assert set(said) == set(commands), "README's synopsis lists exactly the subcommands"
    for name, p in commands.items():
        flags = {s for a in p._actions for s in a.option_strings if s not in {"-h", "--help"}}
        shown = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", said[name]))
        assert shown == flags, \
            f"vramshare {name}: README misses {sorted(flags - shown)}, names unknown {sorted(shown - flags)}"
        for a in p._actions:
            if a.choices and a.option_strings and not isinstance(a, argparse._SubParsersAction):
                assert "{" + ",".join(a.choices) + "}" in said[name], f"vramshare {name} {a.option_strings[0]}: choices"


def test_every_repository_path_readme_names_exists():
    """README names files an admin opens (deploy/..., bench/results/..., tests/...): each must be there.
    Paths with a placeholder (<trace>, {a,b}, *) are patterns, not files."""
    top = "deploy|tests|bench|vramshare|deviceplugin|extender|standins|vramshare_cli|vllm_patches|protos"
    for doc in ("README.md", "vllm_patches/README.md"):
        text = (ROOT / doc).read_text(encoding="utf-8")
        named = set(re.findall(rf"(?<![\w/.-])((?:{top})/[\w./{{}},*<>-]*)", text))
        assert len(named) > (20 if doc == "README.md" else 0)
        for path in (p.rstrip(".,:)") for p in named if not set("{*<") & set(p)):
            assert (ROOT / path).exists() or (ROOT / doc).parent.joinpath(path).exists(), f"{doc} names {path}"
