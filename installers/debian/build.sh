#!/usr/bin/env bash
# Build the Debian package of volunteerd with dpkg-deb: no root, no network but the
# package index.
#
#   installers/debian/build.sh [--out DIR] [--wheel FILE] [--python PY] [--torch SPEC]
#                              [--compression zstd|gzip|xz]
#
# The package holds a self-contained Python environment for Debian's own interpreter:
#
#   /opt/volunteerd/                         a virtual environment made by hand at its
#     pyvenv.cfg, bin/python3.X -> /usr/bin/python3.X     final path (venvs do not move)
#     lib/python3.X/site-packages/           volunteerd and every dependency, torch's
#                                            CPU build included (pip install --target)
#     bin/volunteerd                         the command (#!/opt/volunteerd/bin/python)
#   /usr/bin/volunteerd                      a link to it
#   /usr/lib/systemd/user/volunteerd.service the daemon, as a systemd user unit
#   /usr/share/applications/volunteerd-tray.desktop   the tray, in the menus
#   /usr/share/icons/hicolor/scalable/apps/volunteerd.svg
#   /usr/share/doc/volunteerd/README.Debian  how each user turns it on
#
# The compiled parts of the dependencies are for one Python version: the one that runs
# this script (--python, default python3; 3.11 for Debian 12). The package depends on
# that version's Debian interpreter, python3.X. Nothing is started for anyone: each user
# who wants to contribute enables it (`systemctl --user enable --now volunteerd`).
#
# torch: torch==TORCH_VERSION+cpu (--torch overrides), from the configured package
# index if it has it, else from PyTorch's CPU index: a package for every machine, GPU or
# not, and hundreds of MB rather than several GB.
set -euo pipefail

TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
MAINTAINER=${VOLUNTEERD_DEB_MAINTAINER:-volunteerd developers <maintainers@volunteerd.invalid>}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

usage() {
    cat <<EOF
usage: build.sh [--out DIR] [--wheel FILE] [--python PY] [--torch SPEC]
                [--compression zstd|gzip|xz]

Build volunteerd_<version>_<arch>.deb.

  --out DIR      where to write the package (default: ./dist)
  --wheel FILE   package this volunteerd wheel (default: build one from this checkout)
  --python PY    the Python 3.X that installs the dependencies; the package then needs
                 Debian's python3.X (default: python3)
  --torch SPEC   the torch requirement (default: torch==$TORCH_VERSION+cpu)
  --compression  zstd (default: fast; dpkg 1.21.18+, Debian 12, Ubuntu 21.10+),
                 gzip (any dpkg) or xz (smallest, slowest)
  -h, --help     this text
EOF
}

say() { printf 'build.sh: %s\n' "$*"; }
die() {
    printf 'build.sh: error: %s\n' "$*" >&2
    exit 1
}

out=dist
wheel=
python=python3
torch="torch==$TORCH_VERSION+cpu"
compression=zstd
while [ $# -gt 0 ]; do
    case $1 in
    --out | --wheel | --python | --torch | --compression)
        [ $# -ge 2 ] || die "$1 needs a value (see --help)"
        case $1 in
        --out) out=$2 ;;
        --wheel) wheel=$2 ;;
        --python) python=$2 ;;
        --torch) torch=$2 ;;
        --compression) compression=$2 ;;
        esac
        shift 2
        ;;
    -h | --help) usage && exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
    esac
done
command -v dpkg-deb >/dev/null || die "dpkg-deb is missing (apt install dpkg)"
case $compression in
zstd | gzip) level=1 ;;
xz) level=0 ;;
*) die "--compression is zstd, gzip or xz" ;;
esac
py_version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])') ||
    die "cannot run '$python'"
arch=$(dpkg --print-architecture)
mkdir -p "$out"
out=$(cd "$out" && pwd)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# pip runs in a throw-away environment: the build Python's own packages stay out of it.
"$python" -m venv "$work/venv" >/dev/null ||
    die "'$python' cannot create a virtual environment (apt install python3-venv)"
pip() {
    PIP_ROOT_USER_ACTION=ignore "$work/venv/bin/python" -m pip --disable-pip-version-check "$@"
}

# -- the wheel -----------------------------------------------------------------------------

if [ -z "$wheel" ]; then
    # From a copy: setuptools' build/ folder in a checkout can hold files since deleted.
    say "building the volunteerd wheel from $root"
    mkdir "$work/src"
    tar -C "$root" -c --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./dist \
        --exclude=./test-artifacts --exclude='./.*_cache' --exclude=./.hypothesis \
        --exclude='*.egg-info' --exclude=__pycache__ . | tar -C "$work/src" -x
    pip wheel --quiet --no-deps --wheel-dir "$work/wheel" "$work/src"
    wheel=$(echo "$work"/wheel/volunteerd-*.whl)
fi
[ -f "$wheel" ] || die "no wheel at '$wheel'"
name=$(basename "$wheel")
py_pkg_version=${name#volunteerd-}
py_pkg_version=${py_pkg_version%%-*}
# PEP 440 -> Debian: a pre-release sorts before its release with "~" (0.1.0.dev0 ->
# 0.1.0~dev0, 1.0rc1 -> 1.0~rc1).
version=$(printf '%s' "$py_pkg_version" | sed -E 's/\.?(dev|a|b|rc)([0-9]*)/~\1\2/')

# -- the environment -----------------------------------------------------------------------

stage=$work/stage
prefix=/opt/volunteerd
site=$stage$prefix/lib/python$py_version/site-packages
mkdir -p "$site" "$stage$prefix/bin"

if [[ $torch == "torch==$TORCH_VERSION+cpu" ]] &&
    ! pip install --quiet --dry-run --no-deps "$torch" >/dev/null 2>&1; then
    torch_index=(--extra-index-url "$CPU_INDEX")
else
    torch_index=()
fi
say "installing $name and its dependencies ($torch) for Python $py_version"
# No .pyc files in the package: postinst compiles them for the interpreter installed.
pip install --quiet --no-compile --target "$site" "${torch_index[@]}" "$torch" "$wheel"
rm -rf "${site:?}/bin" # console scripts made for this Python; bin/volunteerd is written below

cat >"$stage$prefix/pyvenv.cfg" <<EOF
home = /usr/bin
include-system-site-packages = false
version = $py_version
EOF
# Debian's own Python modules (PyGObject, for the tray's AppIndicator and GTK menus)
# after every one of ours; no user site-packages ahead of ours either.
cat >"$site/debian-dist-packages.pth" <<EOF
# Debian's python3-* modules, after volunteerd's own (installers/debian/build.sh)
/usr/lib/python3/dist-packages
EOF
ln -s "/usr/bin/python$py_version" "$stage$prefix/bin/python$py_version"
ln -s "python$py_version" "$stage$prefix/bin/python3"
ln -s "python$py_version" "$stage$prefix/bin/python"
cat >"$stage$prefix/bin/volunteerd" <<EOF
#!$prefix/bin/python
import sys

from volunteerd.cli import main

sys.exit(main())
EOF
chmod 0755 "$stage$prefix/bin/volunteerd"
mkdir -p "$stage/usr/bin"
ln -s "$prefix/bin/volunteerd" "$stage/usr/bin/volunteerd"

# -- the autostart files, for users to enable ------------------------------------------

say "rendering the systemd user unit and the tray's desktop entry"
PYTHONPATH=$site "$work/venv/bin/python" -m volunteerd service render --platform linux \
    --exec /usr/bin/volunteerd --out "$work/render" >/dev/null
install -D -m 0644 "$work/render/volunteerd.service" \
    "$stage/usr/lib/systemd/user/volunteerd.service"
install -D -m 0644 "$work/render/volunteerd-tray.desktop" \
    "$stage/usr/share/applications/volunteerd-tray.desktop"
install -D -m 0644 "$work/render/volunteerd.svg" \
    "$stage/usr/share/icons/hicolor/scalable/apps/volunteerd.svg"
install -D -m 0644 "$here/README.Debian" "$stage/usr/share/doc/volunteerd/README.Debian"

# -- the package ---------------------------------------------------------------------------

mkdir -p "$stage/DEBIAN"
installed_kb=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
cat >"$stage/DEBIAN/control" <<EOF
Package: volunteerd
Version: $version
Architecture: $arch
Maintainer: $MAINTAINER
Installed-Size: $installed_kb
Depends: python$py_version, libc6 (>= 2.28)
Recommends: python3-gi, gir1.2-ayatanaappindicator3-0.1
Section: science
Priority: optional
Description: volunteer computing daemon: train neural networks together on home PCs
 volunteerd lends this computer to a swarm that trains huge neural networks together
 (Learning@home, a decentralized mixture of experts over libp2p). It hosts a few
 experts and serves their forward and backward passes to researchers' trainers.
 .
 The package holds volunteerd and its dependencies (PyTorch's CPU build among them)
 in /opt/volunteerd, a systemd user unit and the tray icon's desktop entry. Nothing
 runs until a user enables it: systemctl --user enable --now volunteerd.
EOF
for script in postinst prerm; do
    sed "s/@PYTHON_VERSION@/$py_version/g" "$here/$script" >"$stage/DEBIAN/$script"
    chmod 0755 "$stage/DEBIAN/$script"
done
(cd "$stage" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' |
    xargs -0 md5sum >DEBIAN/md5sums)

deb=$out/volunteerd_${version}_$arch.deb
say "packing $deb"
# The fastest level: torch is most of it and compresses poorly (zstd -1: 4 s, 250 MB;
# gzip -1: 17 s, 275 MB; xz -0: 80 s, 200 MB).
dpkg-deb --root-owner-group "-Z$compression" "-z$level" --build "$stage" "$deb" >/dev/null
say "built $deb ($(du -h "$deb" | cut -f1))"
