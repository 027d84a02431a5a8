"""Build SlideFormer Studio as a self-contained desktop bundle for this platform.

    pip install -e '.[installer]'        # PyInstaller, once
    python build_installer.py            # dist/SlideFormerStudio/ and an archive in dist/
    python build_installer.py --smoke    # run the built bundle's self-test in a clean environment

The bundle is a PyInstaller one-folder build of ``packaging/entry.py`` (the ``slideformer``
command line; with no arguments it opens the app). It carries the Python, torch, Qt and every
library of the environment this script runs in: build in an environment with the CPU build of
torch for a small bundle that runs anywhere, or with a CUDA build for one that trains on NVIDIA
GPUs (see the README, "Install the desktop app").

Linux: ``dist/SlideFormerStudio-<version>-linux-<arch>.tar.gz`` holding the bundle folder, a
launcher ``slideformer-studio``, a ``.desktop`` entry, the icon and ``install-desktop-entry.sh``;
plus an AppImage when ``appimagetool`` is on PATH. Windows: a zip, plus an installer when Inno
Setup's ``iscc`` is on PATH. macOS: a zip of the folder.

``--smoke`` unpacks the archive into a new temporary folder and runs
``slideformer-studio --self-test`` there with an empty environment (PATH=/usr/bin:/bin, HOME in
the temporary folder), so neither this source tree nor the build environment can be reached.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
NAME = "SlideFormerStudio"
LAUNCHER = "slideformer-studio"
DIST = ROOT / "dist"
WORK = ROOT / "build" / "pyinstaller"
ICON = ROOT / "slideformer" / "gui" / "resources" / "icons" / "slideformer.svg"

# Installed in a development environment but not used by the app; PyInstaller would follow
# torch's optional imports into some of them. (Not sympy: autograd imports it on the first
# backward pass, which the bundle's self-test checks.)
EXCLUDES = ["transformers", "pytest", "_pytest", "pytestqt", "pytest_benchmark", "IPython",
            "matplotlib", "tkinter", "scipy", "pandas", "networkx", "tensorboard",
            "torch.utils.tensorboard", "onnx", "tests", "PyInstaller"]

DESKTOP_ENTRY = """[Desktop Entry]
Type=Application
Name=SlideFormer Studio
Comment=Full-parameter fine-tuning of LLMs larger than your GPU
Exec={exec} %F
Icon={icon}
Terminal=false
Categories=Development;Science;
"""

LAUNCHER_SCRIPT = """#!/bin/sh
# Start SlideFormer Studio from the folder this script is in (arguments go to `gui`).
here="$(dirname "$(readlink -f "$0")")"
exec "$here/{name}/{name}" gui "$@"
"""

INSTALL_SCRIPT = """#!/bin/sh
# Add SlideFormer Studio to the desktop's application menu (for this user).
set -e
here="$(dirname "$(readlink -f "$0")")"
apps="${{XDG_DATA_HOME:-$HOME/.local/share}}/applications"
icons="${{XDG_DATA_HOME:-$HOME/.local/share}}/icons/hicolor/scalable/apps"
mkdir -p "$apps" "$icons"
cp "$here/{launcher}.svg" "$icons/{launcher}.svg"
sed "s|^Exec=.*|Exec=\\"$here/{launcher}\\" %F|" "$here/{launcher}.desktop" > "$apps/{launcher}.desktop"
echo "added $apps/{launcher}.desktop"
"""


def version() -> str:
    sys.path.insert(0, str(ROOT))
    from slideformer.engine import __version__
    return __version__


def platform_tag() -> str:
    system = {"linux": "linux", "win32": "windows", "darwin": "macos"}.get(sys.platform,
                                                                          sys.platform)
    return f"{system}-{platform.machine().lower() or 'unknown'}"


def archive_path() -> Path:
    ext = ".tar.gz" if sys.platform.startswith("linux") else ".zip"
    return DIST / f"{NAME}-{version()}-{platform_tag()}{ext}"


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def require_pyinstaller() -> None:
    try:
        import PyInstaller  # noqa: F401
    except ImportError:
        print("error: PyInstaller is not installed in this environment; install it with\n"
              "  pip install -e '.[installer]'", file=sys.stderr)
        sys.exit(2)


def run_pyinstaller() -> Path:
    sep = os.pathsep
    args = [sys.executable, "-m", "PyInstaller", str(ROOT / "packaging" / "entry.py"),
            "--name", NAME, "--onedir", "--noconfirm", "--clean", "--log-level", "WARN",
            "--distpath", str(DIST), "--workpath", str(WORK), "--specpath", str(WORK),
            "--paths", str(ROOT),
            # Command handlers import their modules when they run, so follow every module.
            "--collect-submodules", "slideformer",
            "--add-data", f"{ROOT / 'slideformer' / 'gui' / 'resources'}{sep}slideformer/gui/resources",
            # the CPU AdamW kernel's C source, compiled on the user's machine at first use
            "--add-data", f"{ROOT / 'slideformer' / 'engine' / 'kernels' / 'cpu_adam.c'}{sep}slideformer/engine/kernels"]
    for name in EXCLUDES:
        args += ["--exclude-module", name]
    subprocess.run(args, check=True, cwd=ROOT)
    bundle = DIST / NAME
    # Python files of the resources package are compiled into the bundle; keep only data.
    for cache in (bundle / "_internal" / "slideformer" / "gui" / "resources").rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)
    return bundle


def linux_archive(bundle: Path) -> list[Path]:
    stage_root = WORK / "stage"
    shutil.rmtree(stage_root, ignore_errors=True)
    top = f"{NAME}-{version()}-{platform_tag()}"
    stage = stage_root / top
    stage.mkdir(parents=True)
    shutil.copytree(bundle, stage / NAME, symlinks=True)
    for name, text in ((LAUNCHER, LAUNCHER_SCRIPT.format(name=NAME)),
                       ("install-desktop-entry.sh", INSTALL_SCRIPT.format(launcher=LAUNCHER))):
        (stage / name).write_text(text)
        (stage / name).chmod(0o755)
    (stage / f"{LAUNCHER}.desktop").write_text(DESKTOP_ENTRY.format(exec=LAUNCHER, icon=LAUNCHER))
    shutil.copy(ICON, stage / f"{LAUNCHER}.svg")
    out = archive_path()
    with tarfile.open(out, "w:gz") as tar:
        tar.add(stage, arcname=top)
    made = [out]
    tool = shutil.which("appimagetool")
    if tool:
        made.append(appimage(bundle, tool))
    else:
        print("appimagetool is not on PATH: no AppImage built")
    return made


def appimage(bundle: Path, tool: str) -> Path:
    appdir = WORK / f"{NAME}.AppDir"
    shutil.rmtree(appdir, ignore_errors=True)
    shutil.copytree(bundle, appdir / NAME, symlinks=True)
    (appdir / "AppRun").write_text(
        '#!/bin/sh\nhere="$(dirname "$(readlink -f "$0")")"\n'
        f'exec "$here/{NAME}/{NAME}" gui "$@"\n')
    (appdir / "AppRun").chmod(0o755)
    (appdir / f"{LAUNCHER}.desktop").write_text(DESKTOP_ENTRY.format(exec=LAUNCHER,
                                                                     icon=LAUNCHER))
    shutil.copy(ICON, appdir / f"{LAUNCHER}.svg")
    out = DIST / f"{NAME}-{version()}-{platform.machine()}.AppImage"
    subprocess.run([tool, str(appdir), str(out)], check=True,
                   env={**os.environ, "ARCH": platform.machine()})
    return out


def zip_archive(bundle: Path) -> list[Path]:
    out = archive_path()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for path in sorted(bundle.rglob("*")):
            z.write(path, Path(NAME) / path.relative_to(bundle))
    made = [out]
    iscc = shutil.which("iscc") or shutil.which("ISCC")
    if sys.platform == "win32" and iscc:
        made.append(inno_installer(bundle, iscc))
    elif sys.platform == "win32":
        print("Inno Setup (iscc) is not on PATH: no installer built, only the zip")
    return made


def inno_installer(bundle: Path, iscc: str) -> Path:
    script = WORK / "installer.iss"
    base = f"{NAME}-{version()}-setup"
    script.write_text(f"""[Setup]
AppName=SlideFormer Studio
AppVersion={version()}
DefaultDirName={{autopf}}\\SlideFormer Studio
DefaultGroupName=SlideFormer Studio
OutputDir={DIST}
OutputBaseFilename={base}
Compression=lzma2
SolidCompression=yes
PrivilegesRequired=lowest
[Files]
Source: "{bundle}\\*"; DestDir: "{{app}}"; Flags: recursesubdirs
[Icons]
Name: "{{group}}\\SlideFormer Studio"; Filename: "{{app}}\\{NAME}.exe"; Parameters: "gui"
""")
    subprocess.run([iscc, str(script)], check=True)
    return DIST / f"{base}.exe"


def build() -> int:
    require_pyinstaller()
    import torch
    print(f"building {NAME} {version()} for {platform_tag()} with torch {torch.__version__} "
          f"({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU'} build)", flush=True)
    t0 = time.monotonic()
    bundle = run_pyinstaller()
    made = (linux_archive(bundle) if sys.platform.startswith("linux") else zip_archive(bundle))
    took = time.monotonic() - t0
    print(f"bundle: {bundle.relative_to(ROOT)} ({mib(folder_size(bundle))})")
    for path in made:
        print(f"built:  {path.relative_to(ROOT)} ({mib(path.stat().st_size)})")
    print(f"build time: {took:.0f} s")
    return 0


def smoke() -> int:
    archive = archive_path()
    if not archive.is_file():
        print(f"error: {archive.relative_to(ROOT)} does not exist; run "
              f"`python build_installer.py` first", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="slideformer-smoke-") as tmp:
        tmp = Path(tmp)
        if archive.name.endswith(".tar.gz"):
            with tarfile.open(archive) as tar:
                if hasattr(tarfile, "tar_filter"):  # Python >= 3.10.12 / 3.11.4
                    tar.extractall(tmp, filter="tar")
                else:
                    tar.extractall(tmp)
            top = next(p for p in tmp.iterdir() if p.is_dir())
            command = [str(top / LAUNCHER), "--self-test"]
        else:
            with zipfile.ZipFile(archive) as z:
                z.extractall(tmp)
            exe = tmp / NAME / (NAME + (".exe" if sys.platform == "win32" else ""))
            exe.chmod(0o755)
            command = [str(exe), "gui", "--self-test"]
        home = tmp / "home"
        home.mkdir()
        env = {"HOME": str(home), "QT_QPA_PLATFORM": "offscreen", "LANG": "C.UTF-8"}
        if sys.platform == "win32":
            env |= {"SYSTEMROOT": os.environ.get("SYSTEMROOT", r"C:\Windows"),
                    "PATH": os.environ.get("SYSTEMROOT", r"C:\Windows") + r"\System32",
                    "USERPROFILE": str(home), "TEMP": str(tmp), "TMP": str(tmp)}
        else:
            env |= {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp)}
        print(f"smoke test: {' '.join(command[-2:])} in a clean environment", flush=True)
        done = subprocess.run(command, cwd=home, env=env, timeout=600)
    print(f"smoke test {'passed' if done.returncode == 0 else 'FAILED'} "
          f"(exit code {done.returncode}, {time.monotonic() - t0:.0f} s)")
    return 0 if done.returncode == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="run the built bundle's self-test in a clean environment "
                             "(builds nothing)")
    args = parser.parse_args(argv)
    return smoke() if args.smoke else build()


if __name__ == "__main__":
    sys.exit(main())
