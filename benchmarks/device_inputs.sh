# Sourced by the gpu_*.sh scripts, from the repository root: what every run on the lent GPU machine sets up first.
# That machine starts bare and receives only the checkout (benchmarks/README.md): missing Python packages come as
# wheels in .whl/, the fixture target and the drafters as xz tarballs in .devdata/final/.

# Install the wheels of .whl/ (if any) beside the machine's packages; put the checkout on PYTHONPATH.
device_python_env() {
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
}

# Unpack the fixture target into .fixture/ and the exported drafters into .devdata/ where they are not there yet.
unpack_fixture_inputs() {
  [ -d .fixture/sharegpt-llama-19m ] || xz -dc .devdata/final/fixture.tar.xz | tar -x
  [ -d .devdata/eagle3_run1 ] || tar -C .devdata -xJf .devdata/final/drafters.tar.xz
  if [ ! -d .devdata/dflash_run1/dflash ] && [ -f .devdata/final/dflash_export.tar.xz ]; then
    mkdir -p .devdata/dflash_run1 && tar -C .devdata/dflash_run1 -xJf .devdata/final/dflash_export.tar.xz
  fi
}

# Copy the fixture target and the MT-bench prompts to where tests/conftest.py looks for them (../shared).
place_shared_fixtures() {
  mkdir -p ../shared/fixtures/targets ../shared/data/mt_bench
  [ -d ../shared/fixtures/targets/sharegpt-llama-19m ] || cp -r .fixture/sharegpt-llama-19m ../shared/fixtures/targets/
  [ -f ../shared/data/mt_bench/question.jsonl ] || cp .devdata/question.jsonl ../shared/data/mt_bench/
}
