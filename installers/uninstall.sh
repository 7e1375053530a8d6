#!/bin/sh
# Remove what installers/install.sh installed for this user, on Linux or macOS.
#
#   installers/uninstall.sh [--purge]
#
# Stops the daemon and the autostart (`volunteerd service uninstall`), then removes the
# environment and the ~/.local/bin/volunteerd link. The user's data stays where it is
# (identity, configuration, checkpoints, statistics: a later install carries on with
# them) unless --purge, which removes the data, config and cache folders too.
set -eu

usage() {
    cat <<EOF
usage: uninstall.sh [--purge]

Stop volunteerd, remove its autostart, its environment and the volunteerd command.

  --purge     also remove this user's volunteerd data (identity key, checkpoints,
              statistics), configuration and cache
  -h, --help  this text
EOF
}

say() { printf 'uninstall: %s\n' "$*"; }
die() {
    printf 'uninstall: error: %s\n' "$*" >&2
    exit 1
}

purge=no
while [ $# -gt 0 ]; do
    case $1 in
    --purge) purge=yes && shift ;;
    -h | --help) usage && exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
    esac
done
[ -n "${HOME:-}" ] || die "HOME is not set"

# An XDG base directory as volunteerd/paths.py finds it: $1 if it is an absolute path,
# else $2 (the spec: an empty or relative value is invalid, and must be ignored).
xdg() { case ${1:-} in /*) printf '%s' "$1" ;; *) printf '%s' "$2" ;; esac; }

# The platform's folders, as volunteerd/paths.py finds them.
os=$(uname -s)
case $os in
Linux)
    data_home=$(xdg "${XDG_DATA_HOME:-}" "$HOME/.local/share")
    config_home=$(xdg "${XDG_CONFIG_HOME:-}" "$HOME/.config")
    data_dir=$data_home/volunteerd
    config_dir=$config_home/volunteerd
    cache_dir=$(xdg "${XDG_CACHE_HOME:-}" "$HOME/.cache")/volunteerd
    log_dir=
    ;;
Darwin)
    data_dir=$HOME/Library/Application\ Support/volunteerd
    config_dir=$data_dir
    cache_dir=$HOME/Library/Caches/volunteerd
    log_dir=$HOME/Library/Logs/volunteerd # the LaunchAgents' output
    ;;
*) die "this uninstaller is for Linux and macOS (on Windows use uninstall.ps1); found $os" ;;
esac
env_dir=$data_dir/env
link=$HOME/.local/bin/volunteerd
volunteerd=$env_dir/bin/volunteerd

# -- stop, forget the autostart ---------------------------------------------------------

if [ -x "$volunteerd" ] && "$volunteerd" --version >/dev/null 2>&1; then
    # Folders moved by VOLUNTEERD_DATA_DIR and friends are not purged below: say so.
    moved=$("$volunteerd" paths |
        sed -n -e 's/^data_dir  *//p' -e 's/^config_file  *//p' -e 's/^cache_dir  *//p' |
        grep -vxF -e "$data_dir" -e "$config_dir/config.toml" -e "$cache_dir" || true)
    say "stopping volunteerd and removing its autostart: volunteerd service uninstall"
    stopped=0
    said=$("$volunteerd" service uninstall 2>&1) || stopped=$?
    if [ "$purge" = yes ]; then
        # its line on the data it leaves alone is not the last word: --purge removes it
        printf '%s\n' "$said" | grep -v 'are not touched by this command$' || true
    else
        printf '%s\n' "$said"
    fi
    [ "$stopped" = 0 ] || die "'volunteerd service uninstall' failed (see above)"
else
    # No working environment to ask: remove the autostart files it writes by hand.
    moved=
    say "no working volunteerd in $env_dir; removing its autostart files directly"
    if [ "$os" = Darwin ]; then
        for label in org.volunteerd.tray org.volunteerd.daemon; do
            launchctl bootout "gui/$(id -u)/$label" 2>/dev/null || true
            rm -f "$HOME/Library/LaunchAgents/$label.plist"
        done
    else
        systemctl --user disable --now volunteerd.service >/dev/null 2>&1 || true
        rm -f "$config_home/systemd/user/volunteerd.service" \
            "$config_home/systemd/user/default.target.wants/volunteerd.service" \
            "$config_home/autostart/volunteerd-tray.desktop" \
            "$data_home/icons/hicolor/scalable/apps/volunteerd.svg"
        systemctl --user daemon-reload >/dev/null 2>&1 || true
    fi
fi

# -- the installation --------------------------------------------------------------------

if [ -L "$link" ]; then
    case $(readlink "$link") in
    "$env_dir"/*)
        say "removing $link"
        rm -f "$link"
        ;;
    *) say "left $link as it is (it points elsewhere)" ;;
    esac
fi
if [ -e "$env_dir" ]; then
    say "removing the environment $env_dir"
    rm -rf "$env_dir"
fi

# -- the user's data ---------------------------------------------------------------------

if [ "$purge" = yes ]; then
    for dir in "$data_dir" "$config_dir" "$cache_dir" ${log_dir:+"$log_dir"}; do
        if [ -e "$dir" ]; then
            say "removing $dir"
            rm -rf "$dir"
        fi
    done
    if [ -n "$moved" ]; then
        say "left these, set by VOLUNTEERD_* variables; remove them yourself if you wish:"
        printf '    %s\n' "$moved"
    fi
    say "volunteerd and all its data are removed"
else
    say "volunteerd is removed; your data stays in $data_dir"
    say "(identity, checkpoints, statistics) and your settings in $config_dir;"
    say "a new install carries on with them. To remove them too: uninstall.sh --purge"
fi
