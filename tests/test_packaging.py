"""attention_jax.kernels is installed from kernels/, editable or not, and no top-level `kernels`."""

import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import attention_jax.kernels

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_editable_install_maps_kernels_into_the_package():
  assert pathlib.Path(attention_jax.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"


def test_a_second_checkout_run_with_this_environment_imports_its_own_kernels(tmp_path):
  # The editable install maps attention_jax.kernels to this checkout; another
  # checkout (a clean clone making a table) must not mix its package with these kernels.
  checkout = tmp_path / "checkout"
  for part in ("attention_jax", "kernels"):
    shutil.copytree(ROOT / part, checkout / part,
                    ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(ROOT / "setup.cfg", checkout / "setup.cfg")
  probe = ("import attention_jax, attention_jax.kernels.flash_attention.blockwise as blockwise;"
           "print(attention_jax.__file__); print(attention_jax.kernels.__file__);"
           "print(blockwise.__file__)")
  out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                       text=True, cwd=checkout).stdout.split()
  assert [pathlib.Path(path).resolve() for path in out] == [
      checkout / "attention_jax" / "__init__.py", checkout / "kernels" / "__init__.py",
      checkout / "kernels" / "flash_attention" / "blockwise.py"]


def test_plain_install_into_a_fresh_venv_imports_attention_jax_kernels(tmp_path):
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "-q", "-w", str(tmp_path / "dist"), str(ROOT)], check=True)
  (wheel,) = (tmp_path / "dist").glob("attention_jax-*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  assert "attention_jax/kernels/__init__.py" in names
  assert not any(name.startswith("kernels/") for name in names)

  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
  python = venv / "bin" / "python"
  site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        check=True, capture_output=True, text=True).stdout.strip()
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site,
                  str(wheel)], check=True)
  # The dependencies (jax, flax, ...) come from this environment; a .pth path is not a
  # site dir, so this environment's editable install of attention_jax is not visible there.
  (pathlib.Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
  probe = ("import attention_jax, attention_jax.kernels, importlib.util;"
           "print(attention_jax.kernels.__file__);"
           "print(importlib.util.find_spec('kernels'))")
  out = subprocess.run([python, "-c", probe], check=True, capture_output=True, text=True,
                       cwd=tmp_path).stdout.split("\n")
  assert out[0].startswith(site), out
  assert out[1] == "None", "a top-level `kernels` package must not be installed"
