#!/usr/bin/env bash
# The wheels a bare, offline GPU machine lacks, for Testing/gpu/device.sh:
#
#   bash Testing/gpu/wheels.sh            download and build them into .gpu-wheels/ (needs the package registry)
#   bash Testing/gpu/wheels.sh --check    check that every import device.sh needs is covered by those wheels
#                                         or by the machine's own packages (MACHINE below), versions included
#
# The machine: Python 3.12, x86-64 Linux, and the packages in MACHINE (torch with CUDA, transformers,
# peft, accelerate, ...). Everything else travels as cp312 manylinux wheels, each downloaded with
# --no-deps and each of its dependencies named here. sam2's wheel is built from its sdist without its
# CUDA extension (SAM2_BUILD_CUDA=0: pure Python); medvolcore and medvoltrain are built from this tree.
# PYTHON (default: .venv/bin/python, else python3) runs pip and the builds; it needs torch and
# setuptools (sam2's build imports torch).
#
# WHEELS_DIR (default .gpu-wheels), PY_VERSION (default 3.12) change the folder and the target Python:
# the CPU rehearsal (docs/benchmarks.md) downloads the compiled wheels again for its own Python.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="${WHEELS_DIR:-$repo/.gpu-wheels}"
pyver="${PY_VERSION:-3.12}"
py="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$py" ] || py="$(command -v python3)"

# what the wheels are: NAME==VERSION, pure Python unless marked compiled
PURE=(
  hydra-core==1.3.8 omegaconf==2.3.1  # sam2's runtime
  nibabel==5.4.2                                                                     # medvolcore
  pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0  # xgrammar's
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19                     # medvoltrain
)
COMPILED=(xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 pydantic-core==2.50.5)
SDISTS=(sam2==1.1.0 antlr4-python3-runtime==4.9.3 iopath==0.1.10)  # built here: no wheel of these is published
# the GPU machine's own packages (docs: the device's KINDS.md), the versions seen there; "?" where
# none was read (the check then only asks for the name)
MACHINE="torch=2.11.0 transformers=5.17.0 peft=? accelerate=1.15.0 safetensors=0.8.0 tokenizers=0.23.2
numpy=2.5.2 scipy=? pillow=? tqdm=? pyyaml=? huggingface-hub=1.33.0 triton=3.6.0 packaging=? filelock=?
fsspec=? pandas=? pyarrow=? xxhash=? jinja2=? psutil=? portalocker=? requests=? tensorboard=? setuptools=?
sentencepiece=0.2.2 regex=? markupsafe=? six=? python-dateutil=? protobuf=? urllib3=? certifi=? idna=?
charset-normalizer=? networkx=? sympy=? mpmath=? hf-xet=? httpx=? typer=? click=? rich=? shellingham=?
pluggy=? pytest=? iniconfig=? pygments=? tzdata=? annotated-doc=? anyio=? h11=? httpcore=? aiohttp=?
attrs=? multidict=? yarl=? frozenlist=? aiosignal=? aiohappyeyeballs=? propcache=? absl-py=? grpcio=?
markdown=? werkzeug=? tensorboard-data-server=? cuda-bindings=? cuda-pathfinder=?"

if [ "${1:-}" = "--check" ]; then
  exec "$py" "$here/wheels_check.py" "$dir" "$pyver" "$MACHINE"
elif [ -n "${1:-}" ]; then
  echo "wheels.sh: unknown argument ${1} (use no argument, or --check)" >&2
  exit 2
fi

pure=()
for w in "${PURE[@]}"; do [[ "$w" == *==* ]] && pure+=("$w"); done
[ "$pyver" = 3.12 ] || pure+=(importlib-resources==7.1.0)  # nibabel's, below Python 3.12 (the rehearsal)
mkdir -p "$dir"
pyshort="${pyver/./}"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
echo "wheels: downloading ${#pure[@]} pure and ${#COMPILED[@]} compiled wheels (cp$pyshort) into $dir"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation py \
  --abi none --platform any -d "$dir" "${pure[@]}"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${plat[@]}" -d "$dir" "${COMPILED[@]}"
echo "wheels: building sam2 (SAM2_BUILD_CUDA=0) , antlr4 and iopath from their sdists, medvolcore and medvoltrain"
SAM2_BUILD_CUDA=0 "$py" -m pip wheel -q --no-deps --no-binary=:all: --no-build-isolation -w "$dir" "${SDISTS[@]}"
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "$repo/MedVolCore" "$repo/Training"
rm -rf "$repo/MedVolCore/build" "$repo/Training/build"
ls -l "$dir"/*.whl | awk '{printf "%8.1f KiB  %s\n", $5/1024, $9}'
du -cb "$dir"/*.whl | tail -1 | awk '{printf "total: %.1f MiB (the limit is 40 MiB)\n", $1/1048576}'
total=$(du -cb "$dir"/*.whl | tail -1 | cut -f1)
[ "$total" -lt $((40 * 1048576)) ] || { echo "wheels: over 40 MiB" >&2; exit 1; }
