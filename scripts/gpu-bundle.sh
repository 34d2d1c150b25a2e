#!/usr/bin/env bash
# Builds `merak` with CUDA and gathers, into one folder, what a GPU machine without Rust and
# without Open MPI needs to run it under mpirun:
#   bin/merak.gz        the binary, stripped and compressed (env.sh unpacks it to bin/merak)
#   bin/merak-kernel-tests.gz  with KERNEL_TESTS=1: merak-burn's unit tests built for CUDA (the
#                       CubeCL kernels against the CPU's, benches/gpu/run.sh kernels runs them)
#   bin/mpirun, orted   Open MPI's launcher
#   lib/                the shared libraries merak and Open MPI load, except the C runtime
#                       (glibc, libgcc_s) and the NVIDIA driver's (libcuda comes with the driver;
#                       NCCL and NVRTC come from the machine's Python packages, see env.sh)
#   ompi/, pmix/        Open MPI's and PMIx's plugins and help files, in the layout their
#                       OPAL_PREFIX / PMIX_INSTALL_PREFIX relocation expects
#   python/             Megatron-Core (pure Python, from PyPI) for the benchmark's comparison
#   env.sh              sets PATH, LD_LIBRARY_PATH and the prefixes: `source OUT/env.sh`
#   SOURCES             the fingerprint of the sources built (scripts/source-fingerprint.sh)
#
# Usage: scripts/gpu-bundle.sh [OUT]      (default: gpu-bundle, ignored by git)
#        FEATURES=cuda-autotune scripts/gpu-bundle.sh   (CubeCL autotune on: slow first steps)
#        KERNEL_TESTS=1 scripts/gpu-bundle.sh           (also the kernel tests: 3 more minutes)
# The folder must stay under 64 MiB to travel to the GPU machine; the script fails above it.
# Run it on x86-64 Debian/Ubuntu with Open MPI installed (scripts/deps.sh).
set -euo pipefail

out=${1:-gpu-bundle}
target=${CARGO_TARGET_DIR:-target}
limit_mib=64

case "$out" in
    "" | / | /usr* | /etc* | /bin* | /lib* | "$HOME")
        echo "gpu-bundle: refusing to write the bundle to '$out'" >&2
        exit 2
        ;;
esac
if [ -e "$out" ] && [ ! -f "$out/env.sh" ]; then
    echo "gpu-bundle: '$out' exists and is not a bundle; choose another folder" >&2
    exit 2
fi
ompi_libdir=$(ompi_info --path libdir --parsable 2>/dev/null | sed -n 's/^path:libdir://p')
ompi_pkglibdir=$(ompi_info --path pkglibdir --parsable 2>/dev/null | sed -n 's/^path:pkglibdir://p')
ompi_pkgdatadir=$(ompi_info --path pkgdatadir --parsable 2>/dev/null | sed -n 's/^path:pkgdatadir://p')
ompi_prefix=$(ompi_info --path prefix --parsable 2>/dev/null | sed -n 's/^path:prefix://p')
if [ -z "$ompi_pkglibdir" ] || [ -z "$ompi_prefix" ]; then
    echo "gpu-bundle: Open MPI's ompi_info is not on PATH (install openmpi-bin: scripts/deps.sh)" >&2
    exit 2
fi

# The sources the binaries are built from, taken before the build (benches/gpu/bundle.sh
# compares them with the tree it runs in).
sources=$("$(dirname "${BASH_SOURCE[0]}")/source-fingerprint.sh")
cargo build --release -p merak-launch --features "${FEATURES:-cuda}"

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
cp "$target/release/merak" "$out/bin/merak"
strip "$out/bin/merak"
if [ "${KERNEL_TESTS:-0}" = 1 ]; then
    tests=$(cargo test --release -p merak-burn --features cuda --lib --no-run --message-format=json |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])')
    strip -o "$out/bin/merak-kernel-tests" "$tests"
    gzip -9 "$out/bin/merak-kernel-tests"
fi
cp "$(readlink -f "$(command -v orterun)")" "$out/bin/mpirun"
cp "$(readlink -f "$(command -v orted)")" "$out/bin/orted"

# The C runtime and the driver stay the machine's own.
system='^(libc|libm|libdl|libpthread|librt|libutil|ld-linux-x86-64|libgcc_s|libcuda|libnvidia)\.'
copy_deps() {
    ldd "$1" | awk '/=> \//{print $3}' | while read -r lib; do
        name=$(basename "$lib")
        if ! [[ $name =~ $system ]] && [ ! -e "$out/lib/$name" ]; then
            cp -L "$lib" "$out/lib/$name"
        fi
    done
}

# Open MPI under OUT/ompi, paths relative to its prefix as configured.
rel() { echo "${1#"$ompi_prefix"/}"; }
mkdir -p "$out/ompi/$(rel "$ompi_pkglibdir")" "$out/ompi/$(rel "$ompi_pkgdatadir")" "$out/ompi/etc"
cp -L "$ompi_pkglibdir"/*.so "$out/ompi/$(rel "$ompi_pkglibdir")/"
cp -r "$ompi_pkgdatadir"/. "$out/ompi/$(rel "$ompi_pkgdatadir")/"
# Shared memory and TCP only: the plugins for InfiniBand, UCX and libfabric stay out (and so do
# their libraries); one GPU machine needs none of them.
cat >"$out/ompi/etc/openmpi-mca-params.conf" <<'EOF'
btl = self,vader,tcp
pml = ob1
mtl = ^ofi,psm,psm2
osc = ^ucx
btl_tcp_if_include = lo
EOF
for plugin in "$out/ompi/$(rel "$ompi_pkglibdir")"/*.so; do
    case $(basename "$plugin") in
        *ucx* | *ofi* | *psm* | *verbs* | *openib* | *usnic* | *uct*) rm "$plugin" ;;
        *) copy_deps "$plugin" ;;
    esac
done

# PMIx (external to Debian's Open MPI): its plugins under OUT/pmix/lib/pmix, found through the
# library Open MPI's PMIx plugin loads.
# (awk reads to the end: an early `exit` would end the writer with SIGPIPE, which pipefail
# turns into a failed assignment and set -e into a silent stop.)
pmix_lib=$(find "$out/ompi" -name 'mca_pmix_ext*.so' -exec ldd {} \; | awk '/libpmix\.so/ && !f {f = $3} END {print f}')
if [ -n "$pmix_lib" ]; then
    pmix_prefix=$(dirname "$(dirname "$(readlink -f "$pmix_lib")")")
    if [ -d "$pmix_prefix/lib/pmix" ]; then
        mkdir -p "$out/pmix/lib/pmix"
        cp -L "$pmix_prefix"/lib/pmix/*.so "$out/pmix/lib/pmix/"
        if [ -d "$pmix_prefix/share" ]; then cp -r "$pmix_prefix/share" "$out/pmix/"; fi
        for plugin in "$out/pmix/lib/pmix"/*.so; do copy_deps "$plugin"; done
    fi
fi

copy_deps "$out/bin/merak"
copy_deps "$out/bin/mpirun"
copy_deps "$out/bin/orted"
for lib in "$out/lib"/*; do copy_deps "$lib"; done
# The Vulkan loader (train.device = "wgpu"), which wgpu opens at run time: ldd does not list it.
vulkan=$(ldconfig -p | awk '/libvulkan\.so\.1 .*x86-64/ && !f {f = $NF} END {print f}')
[ -n "$vulkan" ] && cp -L "$vulkan" "$out/lib/libvulkan.so.1"

# The binary travels compressed (a quarter of its size).
gzip -9 "$out/bin/merak"

# Megatron-Core for the comparison row of benches/gpu/run.sh (the GPU machine has no network):
# its pure-Python package from the PyPI wheel, unpacked under OUT/python; the dataset helpers'
# compiled extension (built for one Python version, unused by the benchmark) stays out.
mcore_version=${MEGATRON_CORE_VERSION:-0.16.1}
wheels=$(mktemp -d)
if pip download --quiet --no-deps "megatron-core==$mcore_version" -d "$wheels" >/dev/null 2>&1; then
    mkdir -p "$out/python"
    python3 -m zipfile -e "$wheels"/megatron_core-*.whl "$out/python"
    find "$out/python" -name '*.so' -delete
else
    echo "gpu-bundle: could not download megatron-core $mcore_version; the Megatron-Core row will fail" >&2
fi
rm -rf "$wheels"

cat >"$out/env.sh" <<'EOF'
# Source this file (bash) to run the bundled merak and mpirun: `source gpu-bundle/env.sh`.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -x "$here/bin/merak" ]; then
    gzip -dc "$here/bin/merak.gz" >"$here/bin/merak.partial" && chmod +x "$here/bin/merak.partial" &&
        mv "$here/bin/merak.partial" "$here/bin/merak"
fi
if [ -f "$here/bin/merak-kernel-tests.gz" ] && [ ! -x "$here/bin/merak-kernel-tests" ]; then
    gzip -dc "$here/bin/merak-kernel-tests.gz" >"$here/bin/merak-kernel-tests" &&
        chmod +x "$here/bin/merak-kernel-tests"
fi
export PATH="$here/bin:$PATH"
export OPAL_PREFIX="$here/ompi" OPAL_SYSCONFDIR="$here/ompi/etc" PMIX_INSTALL_PREFIX="$here/pmix"
export OMPI_MCA_mca_base_param_files="$here/ompi/etc/openmpi-mca-params.conf"
# NCCL and NVRTC from the machine's Python packages (site-packages/nvidia/*/lib), if any.
extra=""
for py in python3 python; do
    if command -v "$py" >/dev/null 2>&1; then
        site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
        for d in "$site"/nvidia/*/lib; do [ -d "$d" ] && extra="$extra:$d"; done
        break
    fi
done
# NCCL's packages ship libnccl.so.2 and cuBLAS's libcublasLt.so.<major>, but cudarc looks for
# libnccl.so and libcublasLt.so first: link them in links/.
mkdir -p "$here/links"
for d in ${extra//:/ }; do
    if [ -e "$d/libnccl.so.2" ] && [ ! -e "$d/libnccl.so" ]; then
        ln -sfn "$d/libnccl.so.2" "$here/links/libnccl.so"
    fi
    for lt in "$d"/libcublasLt.so.[0-9]*; do
        if [ -e "$lt" ] && [ ! -e "$d/libcublasLt.so" ] && [ ! -e "$here/links/libcublasLt.so" ]; then
            ln -sfn "$lt" "$here/links/libcublasLt.so"
        fi
    done
done
# The driver's libcuda, where a container mounts it outside the loader's cache.
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do [ -d "$d" ] && extra="$extra:$d"; done
export LD_LIBRARY_PATH="$here/lib:$here/links$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Megatron-Core's Python package (benches/gpu/megatron_gpt.py).
if [ -d "$here/python" ]; then export PYTHONPATH="$here/python${PYTHONPATH:+:$PYTHONPATH}"; fi
# The machine's own PMIx plugins may not match the bundled library; their missing compression
# is harmless for one node.
export PMIX_MCA_pcompress_base_silence_warning=1
# mpirun as root (the GPU machine runs commands as root).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
EOF

echo "$sources" >"$out/SOURCES"

size_kib=$(du -sk "$out" | cut -f1)
echo "gpu-bundle: $out, $((size_kib / 1024)) MiB ($(find "$out" -type f | wc -l) files)"
if [ "$size_kib" -gt $((limit_mib * 1024)) ]; then
    echo "gpu-bundle: over the ${limit_mib} MiB a GPU machine's working tree may carry" >&2
    exit 1
fi
