#!/bin/sh
# Install volunteerd for this user on Linux or macOS, or upgrade it in place.
#
#   installers/install.sh [--wheel FILE | --source DIR] [--torch auto|cpu|cuda|rocm]
#                         [--python PY] [--no-start] [--no-tray] [--dry-run]
#
# It creates an isolated Python environment in the user's data folder, installs PyTorch
# there first (the CPU, CUDA or ROCm build, see "torch" below), then volunteerd (from a
# wheel, or a checkout: by default the one this script is in), links
# ~/.local/bin/volunteerd to it, and runs
# `volunteerd service install`: the per-user autostart of the daemon and the tray, both
# started now. Nothing needs root.
#
# Run it again to upgrade: the environment is kept (torch too, while it is the pinned
# version), volunteerd is reinstalled, the daemon restarted. Identity, configuration,
# checkpoints and statistics live outside the environment and are never touched. What
# can fail without touching the installed volunteerd (pip's upgrade, building the wheel)
# is done before the daemon is stopped; if a later step fails, the installed volunteerd's
# `service install` is run again, and the script says what state it leaves.
#
# Where things go:
#   environment  $XDG_DATA_HOME/volunteerd/env (~/.local/share/volunteerd/env) on Linux,
#                ~/Library/Application Support/volunteerd/env on macOS
#   command      ~/.local/bin/volunteerd, a link to <environment>/bin/volunteerd
#
# torch (the pinned TORCH_VERSION; --torch overrides):
#   macOS                          torch==V from the package index (Apple GPUs through MPS)
#   Linux, `nvidia-smi -L` finds a GPU   torch==V from the package index (PyPI's Linux
#                                  wheel is the CUDA build, several GB with its libraries)
#   Linux x86_64, `rocminfo` finds an AMD GPU   torch==V+rocmX.Y, the ROCm build, from
#                                  PyTorch's ROCm index ($ROCM_INDEX)
#   Linux x86_64 without either    torch==V+cpu, the CPU build (~200 MB): from the
#                                  configured package indexes if they have it, else from
#                                  PyTorch's CPU index ($CPU_INDEX)
#   other Linux machines           torch==V from the package index
# An installed torch of version V is kept on upgrades; --torch cpu, cuda or rocm
# replaces a build of another kind (ROCm: an AMD GPU whose ROCm runtime is not
# installed yet, or that rocminfo does not list).
set -eu

TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
# PyTorch's ROCm builds of TORCH_VERSION: move both together (pytorch.org/get-started
# names the ROCm version of each release).
ROCM_VERSION=7.2
ROCM_INDEX=https://download.pytorch.org/whl/rocm$ROCM_VERSION

usage() {
    cat <<EOF
usage: install.sh [options]

Install volunteerd for this user (or upgrade it), register the daemon and the tray to
start at login, start them, and print the dashboard's address.

  --wheel FILE     install this volunteerd wheel
  --source DIR     install from this checkout of volunteerd
                   (default: the checkout this script is in)
  --torch WHICH    auto (default), cpu, cuda (NVIDIA, Linux) or rocm (AMD, Linux x86_64)
  --python PY      create the environment with this Python (3.11 or newer); replaces
                   an existing environment (default: python3, python3.13, python3.12
                   or python3.11, the first that is 3.11 or newer)
  --no-start       register the autostart, but start nothing now
  --no-tray        no tray icon (the daemon only)
  --dry-run        print what would be done, change nothing
  -h, --help       this text
EOF
}

say() { printf 'install: %s\n' "$*"; }
die() {
    printf 'install: error: %s\n' "$*" >&2
    exit 1
}

source_kind=
source_path=
torch_choice=auto
python=
start=yes
tray=yes
dry_run=no
while [ $# -gt 0 ]; do
    case $1 in
    --wheel | --source | --torch | --python)
        [ $# -ge 2 ] || die "$1 needs a value (see --help)"
        case $1 in
        --wheel) source_kind=wheel source_path=$2 ;;
        --source) source_kind=source source_path=$2 ;;
        --torch) torch_choice=$2 ;;
        --python) python=$2 ;;
        esac
        shift 2
        ;;
    --no-start) start=no && shift ;;
    --no-tray) tray=no && shift ;;
    --dry-run) dry_run=yes && shift ;;
    -h | --help) usage && exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
    esac
done
is_checkout() { [ -f "$1/pyproject.toml" ] && grep -qx 'name = "volunteerd"' "$1/pyproject.toml"; }

case $source_kind in
wheel)
    [ -f "$source_path" ] || die "no wheel at '$source_path'"
    source_path=$(cd "$(dirname "$source_path")" && pwd)/$(basename "$source_path")
    ;;
source)
    is_checkout "$source_path" || die "'$source_path' is not a volunteerd checkout"
    source_path=$(cd "$source_path" && pwd) # (pip reads a bare "src" as a package name)
    ;;
*)
    # volunteerd is not on the package index: the checkout this script came with
    here=$(cd "$(dirname -- "$0")/.." 2>/dev/null && pwd) || here=
    if [ -z "$here" ] || ! is_checkout "$here"; then
        die "name what to install: --source DIR (a checkout of volunteerd) or --wheel FILE"
    fi
    source_kind=source source_path=$here
    ;;
esac
case $torch_choice in
auto | cpu | cuda | rocm) ;;
*) die "--torch takes auto, cpu, cuda or rocm, not '$torch_choice'" ;;
esac
[ -n "${HOME:-}" ] || die "HOME is not set"

os=$(uname -s)
case $os in
Linux)
    # The XDG Base Directory spec: a value that is not an absolute path is ignored.
    case ${XDG_DATA_HOME:-} in
    /*) data_dir=$XDG_DATA_HOME/volunteerd ;;
    *) data_dir=$HOME/.local/share/volunteerd ;;
    esac
    ;;
Darwin) data_dir=$HOME/Library/Application\ Support/volunteerd ;;
*) die "this installer is for Linux and macOS (on Windows use install.ps1); found $os" ;;
esac
case $os/$torch_choice in
Darwin/cuda | Darwin/rocm) die "--torch $torch_choice: PyTorch has no such build for macOS (it uses Apple GPUs as it is)" ;;
esac
if [ "$torch_choice" = rocm ] && [ "$(uname -m)" != x86_64 ]; then
    die "--torch rocm: PyTorch's ROCm builds are for x86_64 Linux only"
fi
env_dir=$data_dir/env
# pip writes the environment's launchers (bin/pip, bin/volunteerd) as a /bin/sh line
# that names the environment's Python in double quotes when the path has a space or is
# long (always on macOS: "Application Support"): a $, ", ` or \ in it there is shell
# syntax, and the launcher fails ("exec: ... not found"). Spaces and letters outside
# ASCII are fine.
case $env_dir in
*'$'* | *'"'* | *'`'* | *\\* | *'
'*)
    die "the environment would be '$env_dir': a \$, \", \` or \\ (or a line break) in its path breaks the launchers pip writes there; set XDG_DATA_HOME (Linux) to a folder without them"
    ;;
esac
bin_dir=$HOME/.local/bin
link=$bin_dir/volunteerd

# -- the Python that creates the environment -------------------------------------------

is_new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; }

find_python() {
    if [ -n "$python" ]; then
        is_new_enough "$python" || die "'$python' is not a Python 3.11 or newer"
        printf '%s\n' "$python"
        return
    fi
    for candidate in python3 python3.13 python3.12 python3.11; do
        if command -v "$candidate" >/dev/null 2>&1 && is_new_enough "$candidate"; then
            printf '%s\n' "$candidate"
            return
        fi
    done
    case $os in
    Darwin) die "volunteerd needs Python 3.11 or newer: install it from python.org or with 'brew install python@3.12', then run this again" ;;
    *) die "volunteerd needs Python 3.11 or newer: install it (e.g. 'sudo apt install python3 python3-venv'), or name one with --python" ;;
    esac
}

# -- which torch -------------------------------------------------------------------------

# What the rule above picks on this machine: cpu, cuda, rocm or default.
detect_torch() {
    if [ "$os" = Darwin ]; then
        echo default
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
        echo cuda
    elif [ "$(uname -m)" = x86_64 ] && command -v rocminfo >/dev/null 2>&1 &&
        rocminfo 2>/dev/null | grep -q 'Name: *gfx'; then
        echo rocm
    elif [ "$(uname -m)" = x86_64 ]; then
        echo cpu
    else
        echo default
    fi
}

describe_torch() {
    case $1 in
    keep) echo "keep the installed torch $torch_installed" ;;
    cpu) echo "torch==$TORCH_VERSION+cpu, the CPU build (from the configured package index if it has it, else $CPU_INDEX)" ;;
    cuda) echo "torch==$TORCH_VERSION from the package index (on Linux its CUDA build: an NVIDIA GPU was found)" ;;
    rocm) echo "torch==$TORCH_VERSION+rocm$ROCM_VERSION, the ROCm build for AMD GPUs (from $ROCM_INDEX)" ;;
    default) echo "torch==$TORCH_VERSION from the package index" ;;
    esac
}

pip() { "$env_dir/bin/python" -m pip --disable-pip-version-check "$@"; }

install_torch() {
    case $1 in
    keep) ;;
    cpu)
        [ "$torch_installed" = "$TORCH_VERSION+cpu" ] && return
        [ -z "$torch_installed" ] || pip uninstall --quiet --yes torch
        want="torch==$TORCH_VERSION+cpu"
        # Asking PyTorch's index only when needed: where it cannot be reached (a mirror
        # that has the CPU build already), pip would retry it for a while.
        if pip install --quiet --dry-run --no-deps "$want" >/dev/null 2>&1; then
            pip install --quiet "$want"
        else
            pip install --quiet --extra-index-url "$CPU_INDEX" "$want"
        fi
        ;;
    rocm)
        [ "$torch_installed" = "$TORCH_VERSION+rocm$ROCM_VERSION" ] && return
        [ -z "$torch_installed" ] || pip uninstall --quiet --yes torch
        pip install --quiet --extra-index-url "$ROCM_INDEX" "torch==$TORCH_VERSION+rocm$ROCM_VERSION"
        ;;
    cuda | default)
        [ "$torch_installed" = "$TORCH_VERSION" ] && return
        # A local build (+cpu) satisfies torch==V for pip: remove it to get the index's.
        case $torch_installed in *+*) pip uninstall --quiet --yes torch ;; esac
        pip install --quiet "torch==$TORCH_VERSION"
        ;;
    esac
}

# -- the plan ----------------------------------------------------------------------------

recreate=no
if [ -x "$env_dir/bin/python" ] && is_new_enough "$env_dir/bin/python"; then
    [ -z "$python" ] || recreate=yes
elif [ -e "$env_dir" ]; then
    recreate=yes # broken: its Python was removed or upgraded away
fi
if [ -x "$env_dir/bin/python" ] && [ "$recreate" = no ]; then
    action=upgrade
    torch_installed=$("$env_dir/bin/python" -c \
        'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
else
    action=create
    base_python=$(find_python)
    torch_installed=
fi

case $torch_choice in
auto)
    if [ -n "$torch_installed" ] && [ "${torch_installed%%+*}" = "$TORCH_VERSION" ]; then
        torch_plan=keep
    else
        torch_plan=$(detect_torch)
    fi
    ;;
*) torch_plan=$torch_choice ;; # cpu, cuda or rocm
esac

case $source_kind in
wheel) source_text="volunteerd from $source_path" ;;
source) source_text="volunteerd from the checkout $source_path" ;;
esac
service_flags=
[ "$start" = yes ] || service_flags="$service_flags --no-start"
[ "$tray" = yes ] || service_flags="$service_flags --no-tray"

if [ "$dry_run" = yes ]; then
    if [ "$action" = create ]; then
        say "would create the environment $env_dir with $base_python ($("$base_python" --version 2>&1))"
    else
        say "would upgrade the environment $env_dir"
    fi
    say "would install torch: $(describe_torch "$torch_plan")"
    say "would install $source_text"
    say "would link $link to $env_dir/bin/volunteerd"
    say "would run: volunteerd service install$service_flags"
    exit 0
fi

# -- on the way out -----------------------------------------------------------------------

warn() { printf 'install: %s\n' "$*" >&2; }

# How far this script got with the installed volunteerd, for what to say (and put back)
# if it fails: untouched, stopped (by its own `service uninstall`, or by its pid), gone
# (its environment removed), registering (the new volunteerd is in place), finished.
stage=untouched
build_dir=
[ -e "$env_dir" ] && installed=yes || installed=no
on_exit() {
    status=$?
    set +e
    [ -z "$build_dir" ] || rm -rf "$build_dir"
    if [ "$status" != 0 ] && [ "$installed" = yes ]; then
        put_back
    fi
    exit "$status"
}
put_back() {
    case $stage in
    untouched) warn "the installed volunteerd was not touched" ;;
    stopped)
        if [ "$stopped_by" = service ] && "$env_dir/bin/volunteerd" --version >/dev/null 2>&1; then
            warn "the upgrade failed; putting the installed volunteerd back: volunteerd service install$service_flags"
            # shellcheck disable=SC2086 # the flags are words on purpose
            if "$env_dir/bin/volunteerd" service install $service_flags; then
                warn "volunteerd is back as it was before; run this script again once the problem above is solved"
                return
            fi
        fi
        warn "the upgrade failed, and volunteerd is stopped; it does not start at login until this script succeeds"
        ;;
    gone) warn "volunteerd is stopped, and its environment $env_dir is incomplete: run this script again once the problem above is solved" ;;
    registering) ;; # said by the die below
    esac
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# -- what can fail without touching the installed volunteerd --------------------------------

build_wheel() {
    build_dir=$(mktemp -d)
    say "building a wheel from $source_path"
    # From a copy: setuptools' build/ folder in a checkout can hold files since deleted.
    mkdir "$build_dir/src"
    tar -C "$source_path" -c --exclude=./.git --exclude=./.venv --exclude=./build \
        --exclude=./dist --exclude='*.egg-info' --exclude=__pycache__ . |
        tar -C "$build_dir/src" -x
    pip wheel --quiet --no-deps --wheel-dir "$build_dir" "$build_dir/src"
    for built in "$build_dir"/volunteerd-*.whl; do source_path=$built; done
    source_kind=wheel
}

if [ "$action" = upgrade ]; then
    pip install --quiet --upgrade pip
fi
# With the environment's pip, where it has one that works (not when new or broken).
if [ "$source_kind" = source ] && [ -x "$env_dir/bin/python" ] && pip --version >/dev/null 2>&1; then
    build_wheel
fi

# -- stop the installed volunteerd ----------------------------------------------------------

# Whether $1 runs (a zombie that no one reaps, in some containers, does not).
is_alive() {
    kill -0 "$1" 2>/dev/null || return 1
    if [ -r "/proc/$1/stat" ]; then
        case $(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null) in Z*) return 1 ;; esac
    fi
}

command_of() {
    if [ -r "/proc/$1/cmdline" ]; then
        tr '\0' ' ' <"/proc/$1/cmdline"
    else
        ps -o command= -p "$1" 2>/dev/null || true
    fi
}

# Stop the process whose pid is in the file $1 (what $2 is, in words), if it runs
# volunteerd: a stale pid may have been reused by another program.
stop_by_pid() {
    pid=$(head -n 1 "$1" 2>/dev/null | tr -cd 0-9)
    [ -n "$pid" ] && is_alive "$pid" || return 0
    case $(command_of "$pid") in *volunteerd*) ;; *) return 0 ;; esac
    say "stopping the running volunteerd $2 (pid $pid): its environment is to be replaced"
    kill -TERM "$pid" 2>/dev/null || return 0
    waited=0
    while is_alive "$pid"; do
        if [ "$waited" -ge 60 ]; then
            say "the $2 (pid $pid) did not stop in 60 s: killing it"
            kill -KILL "$pid" 2>/dev/null || true
            break
        fi
        sleep 1
        waited=$((waited + 1))
    done
}

# The daemon must not run while its files are replaced or removed: it would go on
# running from deleted files, and the new one would not start beside it. Its autostart
# is put back by `service install` below.
stopped_by=
if [ -x "$env_dir/bin/volunteerd" ] && "$env_dir/bin/volunteerd" --version >/dev/null 2>&1; then
    say "stopping the installed volunteerd: volunteerd service uninstall"
    stage=stopped stopped_by=service
    "$env_dir/bin/volunteerd" service uninstall ||
        say "(could not stop it cleanly; carrying on)"
elif [ -e "$env_dir" ]; then
    # Its environment cannot run it any more (its Python is gone): the pids it wrote.
    case ${VOLUNTEERD_DATA_DIR:-} in
    /*) node_dir=$VOLUNTEERD_DATA_DIR ;;
    *) node_dir=$data_dir ;;
    esac
    stage=stopped stopped_by=pid
    stop_by_pid "$node_dir/volunteerd.lock" daemon
    stop_by_pid "$node_dir/tray.pid" tray
fi

# -- the environment ---------------------------------------------------------------------

if [ "$action" = create ]; then
    if [ -e "$env_dir" ]; then
        say "removing the old environment $env_dir"
        stage=gone
        rm -rf "$env_dir"
    fi
    say "creating the environment $env_dir ($("$base_python" --version 2>&1))"
    (umask 077 && mkdir -p "$data_dir") # the data folder is private (docs/configuration.md)
    "$base_python" -m venv "$env_dir" ||
        die "could not create the environment (on Debian or Ubuntu: sudo apt install python3-venv)"
    pip install --quiet --upgrade pip
else
    say "upgrading the environment $env_dir"
fi

case $torch_plan in
keep) say "keeping torch $torch_installed" ;;
*) say "installing $(describe_torch "$torch_plan")" ;;
esac
install_torch "$torch_plan"

# -- volunteerd --------------------------------------------------------------------------

[ "$source_kind" = wheel ] || build_wheel
say "installing $source_text"
# --upgrade installs what the wheel needs (torch stays: it is in range); the second
# step replaces volunteerd even when the wheel has the installed version number.
pip install --quiet --upgrade "$source_path"
pip install --quiet --no-deps --force-reinstall "$source_path"
version=$("$env_dir/bin/volunteerd" --version)

mkdir -p "$bin_dir"
if [ -e "$link" ] && [ ! -L "$link" ]; then
    say "left $link as it is (a file this installer did not make); use $env_dir/bin/volunteerd"
else
    say "linking $link -> $env_dir/bin/volunteerd"
    ln -sfn "$env_dir/bin/volunteerd" "$link"
fi

# -- autostart, start ---------------------------------------------------------------------

say "registering the autostart: volunteerd service install$service_flags"
stage=registering
# shellcheck disable=SC2086 # the flags are words on purpose
"$env_dir/bin/volunteerd" service install $service_flags ||
    die "$version is installed, but 'volunteerd service install' failed (see above): volunteerd is stopped and does not start at login; solve the problem it names, then run 'volunteerd service install$service_flags'"
stage=finished

echo
echo "$version is installed in $env_dir"
case ":${PATH:-}:" in
*":$bin_dir:"*) ;;
*)
    echo "Note: $bin_dir is not on your PATH. Add it (e.g. in ~/.profile):"
    echo "    export PATH=\"\$HOME/.local/bin:\$PATH\""
    ;;
esac
if [ "$start" = yes ]; then
    if url=$("$env_dir/bin/volunteerd" dashboard --print 2>/dev/null); then
        echo "The dashboard: ${url%%#*}  (open it with: volunteerd dashboard)"
    else
        echo "volunteerd does not answer yet: see 'volunteerd service status'"
    fi
else
    echo "volunteerd starts at your next login (or now: volunteerd service install)"
fi
echo "Where its files are: volunteerd paths. To remove it: installers/uninstall.sh"
