"""The image's install path, without a container runtime: build our wheel as the Dockerfile's builder
stage does, install it with deploy/image/install-wheel.sh (the Dockerfile's runtime step) into a clean
virtual environment, and start ``vramshare device-plugin --backend simulated`` and ``vramshare
extender`` from it. Catches what only an installed wheel shows: a module, a generated stub or a data
file (the packaged inventories) left out of the package, an import of the source tree or of tests.

The dependencies are not downloaded (the test runs offline): the clean environment sees the test
environment's installed distributions through a path file, minus vramshare itself, so pip resolves
them as "already satisfied" and installs only our wheel, with the very command the image runs.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request

import pytest
import yaml

from standins.apiserver import ApiServerDouble
from tests.extender import builders as b

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(argv: list[str], **kw: object) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, **kw)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    tmp = tmp_path_factory.mktemp("image")
    wheels = tmp / "wheels"
    # The builder stage: what its COPY lines copy, then `pip wheel .` (here --no-deps, offline and
    # without build isolation). A file the wheel needs but the Dockerfile does not copy fails here.
    src = tmp / "src"
    src.mkdir()
    builder = re.split(r"^FROM ", (ROOT / "Dockerfile").read_text(), flags=re.M)[1]
    for line in re.findall(r"^COPY (.+)$", builder, flags=re.M):
        *sources, _dest = line.split()
        for item in sources:
            path = ROOT / item.rstrip("/")
            if path.is_dir():
                shutil.copytree(path, src / path.name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(path, src / path.name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
          "--wheel-dir", str(wheels), str(src)], cwd=tmp)
    [wheel] = wheels.glob("vramshare-*.whl")
    env_dir = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(env_dir)])
    # Dependencies: the test environment's distributions, without vramshare (nor its editable hook).
    deps = tmp / "deps"
    deps.mkdir()
    for entry in pathlib.Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name.lower()
        if "vramshare" in name or name in {"deviceplugin", "extender", "protos", "vllm_patches", "standins", "tests"} \
                or name.endswith(".pth") or name in {"pip", "setuptools", "_distutils_hack"} \
                or name.startswith(("pip-", "setuptools-")):
            continue
        (deps / entry.name).symlink_to(entry)
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    (site / "zz-test-deps.pth").write_text(str(deps) + "\n")
    env = {"PATH": f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp)}
    out = _run(["sh", str(ROOT / "deploy/image/install-wheel.sh"), str(wheels)], env=env, cwd=tmp)
    assert re.search(r"Successfully installed .*vramshare-", out), out
    return env_dir


def _clean_env(venv: pathlib.Path, tmp: pathlib.Path) -> dict[str, str]:
    """No PYTHONPATH, no source tree: run from a scratch directory with only the venv on PATH."""
    return {"PATH": f"{venv / 'bin'}{os.pathsep}/usr/bin:/bin", "HOME": str(tmp), "KUBECONFIG": ""}


def test_the_installed_package_is_not_the_source_tree(venv: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = _run([str(venv / "bin/python"), "-c",
                "import vramshare, deviceplugin, extender, protos.deviceplugin.v1beta1.api_pb2 as p, "
                "deviceplugin.inventories as inv, os; print(vramshare.__file__); print(p.__file__); "
                "print(os.listdir(os.path.dirname(inv.__file__)))"], env=_clean_env(venv, tmp_path), cwd=tmp_path)
    assert str(ROOT) not in out and str(venv) in out and "demo-node.yaml" in out


def test_the_installed_package_renders_an_install(venv: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """`vramshare install` from a wheel (no clone): the manifests travel in the package (issue 22)."""
    out = _run([str(venv / "bin/vramshare"), "install", "--kubernetes-version", "1.33.2"],
               env=_clean_env(venv, tmp_path), cwd=tmp_path)
    docs = [d for d in yaml.safe_load_all(out) if d]
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "DaemonSet", "Deployment", "Secret", "ValidatingAdmissionPolicy"} <= kinds
    assert "registry.k8s.io/kube-scheduler:v1.33.2" in out


def _wait(proc: subprocess.Popen[str], ok: object, what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not ok():  # type: ignore[operator]
        assert proc.poll() is None, f"{what} exited: {proc.communicate()[0]}"
        assert time.monotonic() < deadline, f"{what} did not start in {limit} s"
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    return out


def test_the_device_plugin_starts_from_the_wheel(venv: pathlib.Path, tmp_path: pathlib.Path) -> None:
    site = next((venv / "lib").glob("python3*/site-packages"))
    inventory = site / "deviceplugin/inventories/demo-node.yaml"
    assert inventory.is_file()
    plugin_dir = tmp_path / "device-plugins"
    plugin_dir.mkdir()
    proc = subprocess.Popen([str(venv / "bin/vramshare"), "device-plugin", "--backend", "simulated",
                             "--inventory", str(inventory), "--device-plugin-dir", str(plugin_dir),
                             "--pod-resources-socket", str(plugin_dir / "pr.sock"),
                             "--quota-dir", str(tmp_path / "quota"), "--node-name", "n1", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_clean_env(venv, tmp_path), cwd=tmp_path)
    _wait(proc, lambda: (plugin_dir / "vramshare-gpu-memory.sock").exists(), "device plugin")
    assert "serving resource=vramshare.io/gpu-memory" in _stop(proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_extender_starts_from_the_wheel(venv: pathlib.Path, tmp_path: pathlib.Path) -> None:
    with ApiServerDouble() as api:
        api.create_node(b.gpu_node("n1", b.l4()))
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "d",
            "clusters": [{"name": "d", "cluster": {"server": api.url}}], "users": [{"name": "u", "user": {}}],
            "contexts": [{"name": "d", "context": {"cluster": "d", "user": "u"}}]}))
        port = _free_port()
        proc = subprocess.Popen([str(venv / "bin/vramshare"), "extender", "--listen", f"127.0.0.1:{port}",
                                 "--kubeconfig", str(kubeconfig)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=_clean_env(venv, tmp_path), cwd=tmp_path)

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
                    return resp.status == 200
            except OSError:
                return False

        _wait(proc, ready, "extender")
        assert "extender started" in _stop(proc)


def test_the_build_script_names_the_image_the_manifests_use() -> None:
    ref = _run(["sh", str(ROOT / "deploy/build-image.sh"), "--print-image"]).strip()
    images = set()
    for path in (ROOT / "deploy/daemonset").rglob("*.yaml"):  # dra/ too
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in ("DaemonSet", "Deployment"):
                images |= {c["image"] for c in doc["spec"]["template"]["spec"]["containers"]}
    ours = {i for i in images if "kube-scheduler" not in i}
    assert ours == {ref}
    assert ref in (ROOT / "README.md").read_text()


def test_the_runtime_stage_installs_only_wheels() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert len(stages) == 2 and " AS builder" in stages[0] and " AS runtime" in stages[1]
    runtime = stages[1]
    assert "install-wheel.sh /wheels" in runtime and "from=builder,source=/wheels" in runtime
    assert not re.search(r"^COPY (?!deploy/image/install-wheel.sh)", runtime, flags=re.M)
    assert not re.search(r"apt-get|gcc|build-essential", runtime)
    assert re.search(r"^USER 65532", runtime, flags=re.M)
    assert shutil.which("sh")
