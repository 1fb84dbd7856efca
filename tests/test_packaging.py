"""What installing and importing commlib does (and does not do)."""

from __future__ import annotations

import subprocess
import sys


def test_import_starts_neither_mpi_nor_threads():
    code = ("import sys, threading, commlib, commlib.ops, commlib.work; "
            "assert 'mpi4py.MPI' not in sys.modules, 'import commlib initialized MPI'; "
            "assert threading.active_count() == 1, threading.enumerate(); "
            "assert commlib.Communicator.__name__ == 'Communicator'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr



def test_wheel_installs_one_name_beside_namesakes(tmp_path):
    """The wheel holds only ``commlib``; installed into a venv that already has packages named
    sparsify, collectives, bindings and benchmarks, it leaves them intact and imports everywhere."""
    import os
    import site
    import venv
    import zipfile

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", repo, "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels)], check=True, timeout=300, cwd=tmp_path)
    (wheel,) = wheels.glob("commlib-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"commlib", wheel.name.split("-py")[0] + ".dist-info"}
    for sub in ("collectives", "sparsify", "bindings", "horovod", "horovod/torch"):
        assert f"commlib/{sub}/__init__.py" in names
    assert not any(n.startswith("commlib/benchmarks") for n in names)

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    namesakes = ("sparsify", "collectives", "bindings", "benchmarks")
    for name in namesakes:     # other projects' top-level packages, already installed
        os.makedirs(os.path.join(purelib, name))
        with open(os.path.join(purelib, name, "__init__.py"), "w") as f:
            f.write(f"OWNER = 'not commlib: {name}'\n")
    subprocess.run([py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], check=True,
                   timeout=300)
    # commlib's dependencies come from this venv, appended after the new venv's own site-packages
    with open(os.path.join(purelib, "zz_deps.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    code = ("import commlib, commlib.collectives, commlib.sparsify, commlib.bindings.torch, "
            "commlib.bindings.jax, commlib.torch, commlib.jax, commlib.horovod.torch; "
            f"assert commlib.__file__.startswith({purelib!r}), commlib.__file__; "
            # the GPU selection's CUDA source ships beside its module (read at first GPU use)
            "from commlib.sparsify.gpu_select import gpu_source; assert '__global__' in gpu_source(); "
            + "; ".join(f"import {n}; assert {n}.OWNER == 'not commlib: {n}'" for n in namesakes))
    # the mpich wheel's libmpi sits under this venv's prefix, where mpi4py finds it by its own prefix
    libdir = os.path.join(sys.prefix, "lib")
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(
        p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p)}
    proc = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=env)
    assert proc.returncode == 0, proc.stderr
