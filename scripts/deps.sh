# Installs what building and testing moe_reroute needs, from Debian's packages
# and PyPI only; quick when everything is already there. Sourced by test.sh
# (everything) and bench.sh (the C++ side only).

MOE_REROUTE_APT_PACKAGES=(
  cmake ninja-build g++ clang libclang-rt-14-dev libomp-dev
  libgtest-dev libcli11-dev libopenmpi-dev openmpi-bin
)
# The versions tested: what the NumPy tests need, what a build with
# --no-build-isolation adds, and the pinned torch (its default x86-64 wheel is
# a CUDA build that also runs on the CPU), and mpi4py for moe_reroute.ep's MPI
# tests (its PyPI wheel loads Debian's Open MPI; the NumPy-only venv goes
# without, where those tests skip).
MOE_REROUTE_TEST_PACKAGES=("numpy>=1.26" "ml_dtypes>=0.5" "pytest>=8")
MOE_REROUTE_BUILD_PACKAGES=("nanobind==2.9.2" "scikit-build-core>=0.10")
MOE_REROUTE_PIP_PACKAGES=(
  "${MOE_REROUTE_TEST_PACKAGES[@]}" "${MOE_REROUTE_BUILD_PACKAGES[@]}" "torch==2.9.1" "mpi4py>=4"
)

install_apt_deps() {
  local missing=()
  for package in "${MOE_REROUTE_APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
  done
  if ((${#missing[@]})); then
    echo "deps: apt-get install ${missing[*]}" >&2
    local sudo=""
    [[ $(id -u) -ne 0 ]] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

# Two more virtual environments for scripts/test.sh: the newest torch and
# nanobind with the rest (it runs the torch operator tests there too), and the
# test packages alone, without torch (it installs the NumPy part there by
# itself, in an isolated build: with the newest nanobind pyproject.toml allows).
MOE_REROUTE_NEWEST_TORCH_PACKAGES=(
  torch nanobind "scikit-build-core>=0.10" "${MOE_REROUTE_TEST_PACKAGES[@]}"
)

# make_venv DIR PACKAGE...: the virtual environment DIR, made once, with the
# newest PACKAGEs (--upgrade: a few seconds when they are already there).
make_venv() {
  local venv=$1
  shift
  [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade --root-user-action=ignore "$@"
}

install_python_deps() {
  echo "deps: checking Python packages (torch is a large download the first time)" >&2
  # A no-op of a few seconds when every pin is already met.
  python3 -m pip install -q --root-user-action=ignore "${MOE_REROUTE_PIP_PACKAGES[@]}"
}
