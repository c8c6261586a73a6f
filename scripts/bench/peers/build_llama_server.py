"""Build llama.cpp's `llama-server` as a benchmark peer (not a dependency of specdec).

The source is the llama.cpp tree vendored in llama-cpp-python's sdist, pinned to one release
so that every machine benchmarks the same server. The build is CPU only, static, Release, with
`-DGGML_NATIVE=ON`, no web UI and no HTTPS (this llama.cpp no longer uses CURL: its downloads
go through cpp-httplib, which needs OpenSSL only for HTTPS). It is compiled into a cache folder
and skipped when the binary is already there. The last line of stdout is the binary's path.

    nice -n 19 python scripts/bench/peers/build_llama_server.py --jobs 2
    python -m specdec.bench.load --peer llama-server --workload long-agent --raw-prompt

Stdlib only, so it runs before anything else is installed; it needs a C/C++ compiler and
cmake >= 3.18 (`pip install cmake` where the system has none).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python's release; its sdist carries the llama.cpp source
DEFAULT_DEST = Path.home() / ".cache" / "specdec" / f"llama-server-{VERSION}"
BINARY_NAME = "llama-server"

# Read from vendor/llama.cpp/CMakeLists.txt, tools/ui/CMakeLists.txt and ggml/CMakeLists.txt
# of this release; the GPU backends are spelled out although they default to off on Linux.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary, movable out of the build tree
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF", "-DGGML_HIP=OFF", "-DGGML_VULKAN=OFF", "-DGGML_METAL=OFF",
    "-DGGML_SYCL=OFF", "-DGGML_OPENCL=OFF", "-DGGML_MUSA=OFF", "-DGGML_WEBGPU=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # The web UI: no npm build and no download of prebuilt assets (the server embeds none).
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",  # the server lives under tools/
)


def find_cmake() -> str:
    """cmake on PATH, else the one `pip install cmake` put beside this interpreter."""
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if found is None:
        raise SystemExit("build_llama_server: cmake not found; install it (pip install cmake) and rerun")
    return found


def download_sdist(workdir: Path) -> Path:
    """The pinned sdist, fetched by pip from PyPI into `workdir`."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         f"llama-cpp-python=={VERSION}", "-d", str(workdir)],
        check=True,
    )
    archives = sorted(workdir.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if not archives:
        raise SystemExit(f"build_llama_server: pip left no sdist in {workdir}")
    return archives[0]


def unpack_llama_cpp(archive: Path, workdir: Path) -> Path:
    """Unpack the sdist; return its vendored llama.cpp source folder."""
    with tarfile.open(archive) as tar:
        tar.extractall(workdir, filter="data")  # refuses links and paths that leave workdir
    source = workdir / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        raise SystemExit(f"build_llama_server: no llama.cpp source in {archive.name}")
    return source


def build(source: Path, build_dir: Path, jobs: int, cmake: str) -> Path:
    subprocess.run([cmake, "-S", str(source), "-B", str(build_dir), *CMAKE_OPTIONS], check=True)
    subprocess.run([cmake, "--build", str(build_dir), "--target", BINARY_NAME, "--config", "Release",
                    "-j", str(jobs)], check=True)
    binary = build_dir / "bin" / BINARY_NAME
    if not binary.exists():
        raise SystemExit(f"build_llama_server: the build finished without {binary}")
    return binary


def ensure_binary(dest: Path, jobs: int, keep_build: bool = False) -> Path:
    """The binary in `dest`, built there unless it already exists."""
    target = dest / BINARY_NAME
    if target.exists():
        return target
    cmake = find_cmake()
    dest.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="build-", dir=dest))
    try:
        source = unpack_llama_cpp(download_sdist(workdir), workdir)
        binary = build(source, workdir / "build", jobs, cmake)
        # Copied under a temporary name, then renamed: a half-copied file is never taken as built.
        partial = dest / f"{BINARY_NAME}.partial{os.getpid()}"
        shutil.copy2(binary, partial)
        os.replace(partial, target)
    finally:
        if not keep_build:
            shutil.rmtree(workdir, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST,
                        help=f"the cache folder for the binary (default: {DEFAULT_DEST})")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default: 2)")
    parser.add_argument("--keep-build", action="store_true",
                        help="keep the unpacked source and build tree beside the binary")
    args = parser.parse_args(argv)
    binary = ensure_binary(args.dest.expanduser(), args.jobs, args.keep_build)
    subprocess.run([str(binary), "--version"], check=True)
    print(binary)


if __name__ == "__main__":
    main()
