# shellcheck shell=bash
# Ruby 3.3 in a Debian 13 (trixie) chroot, beside the system Ruby 3.1 (sourced, not executed).
# Recipe and rationale: /work/shared/ruby33.md. Requires common.sh to be sourced first.
#
# Defines:
#   ruby33_build             debootstrap the chroot if it is missing (atomic, locked)
#   ruby33_ensure_packages   install chroot packages that are missing (e.g. liburing-dev
#                            in a chroot built before it was on the list)
#   ruby33_exec CMD...       run CMD inside the chroot, cwd /src (the repository),
#                            BUNDLE_PATH=vendor/bundle-3.3, BUNDLE_GEMFILE=gemfiles/ruby33.gemfile;
#                            returns CMD's exit status
#
# Mounts. Each ruby33_exec mounts the repository at $ROOT/src plus proc, /dev/pts and a
# /dev/shm tmpfs, runs CMD, and unmounts them from an EXIT trap. Normally this happens in
# a private mount namespace (unshare -m): the mounts are invisible to the rest of the
# machine, concurrent runs (tests + benchmarks) do not interfere, and the kernel drops them
# even if the run is killed with SIGKILL. Where unshare is unavailable (or
# NEVERBLOCK_NO_UNSHARE=1) the mounts go in the host namespace, runs are serialised with a
# lock, and the trap unmounts them. Stale mounts left by an interrupted run or by the manual
# recipe are unmounted first, provided no process is still running inside the chroot.

RUBY33_ROOT="${NEVERBLOCK_RUBY33_ROOT:-/var/cache/neverblock/trixie}"
RUBY33_SUITE=trixie
RUBY33_MIRROR="${NEVERBLOCK_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
RUBY33_LOCK="${RUBY33_ROOT}.lock"
RUBY33_PACKAGES=(ruby ruby-dev bundler build-essential pkg-config git ca-certificates
                 libpq-dev libmariadb-dev libyaml-dev liburing-dev)

# Present = debootstrap finished (see ruby33_build). Missing packages are added later by
# ruby33_ensure_packages.
ruby33_built() { [[ -x "$RUBY33_ROOT/usr/bin/ruby" ]]; }

# Build the chroot into "$ROOT.partial" and rename it when debootstrap succeeded, so an
# interrupted build is never mistaken for a finished one (the next run starts over).
ruby33_build() {
  ruby33_built && return 0
  [[ $EUID -eq 0 ]] || nb_die "building the Ruby 3.3 chroot needs root"
  nb_apt_ensure debootstrap
  mkdir -p "$(dirname "$RUBY33_ROOT")"
  (
    exec 8>"$RUBY33_LOCK"
    flock 8                                # another setup may be building it right now
    ruby33_built && exit 0
    if [[ -e "$RUBY33_ROOT" ]]; then
      nb_die "$RUBY33_ROOT exists but has no Ruby; remove it (rm -rf --one-file-system) to rebuild"
    fi
    local partial="$RUBY33_ROOT.partial" log="$RUBY33_ROOT.debootstrap.log"
    if [[ -e "$partial" ]]; then
      nb_log "removing an interrupted build at $partial"
      _ruby33_umount_all "$partial"
      rm -rf --one-file-system "$partial"
    fi
    nb_log "building the Debian $RUBY33_SUITE chroot at $RUBY33_ROOT (log: $log)"
    local includes
    includes="$(IFS=,; echo "${RUBY33_PACKAGES[*]}")"
    if ! debootstrap --variant=minbase --include="$includes" \
           "$RUBY33_SUITE" "$partial" "$RUBY33_MIRROR" >"$log" 2>&1; then
      tail -n 30 "$log" >&2
      nb_die "debootstrap failed (full log: $log)"
    fi
    mv "$partial" "$RUBY33_ROOT"
  )
}

# Keep the chroot's localhost and DNS in step with the host's, and let it trust what the
# host trusts: the chroot's own CA bundle plus the host's (which may hold a local CA, e.g.
# of an HTTPS proxy in front of rubygems.org) go into one file that SSL_CERT_FILE names.
RUBY33_CA_FILE=/etc/ssl/neverblock-ca-certificates.crt
_ruby33_sync_etc() {
  local f
  for f in /etc/hosts /etc/resolv.conf; do
    cmp -s "$f" "$RUBY33_ROOT$f" || cp --remove-destination -L "$f" "$RUBY33_ROOT$f"
  done
  local host_ca=/etc/ssl/certs/ca-certificates.crt own_ca="$RUBY33_ROOT/etc/ssl/certs/ca-certificates.crt"
  if [[ -r "$host_ca" ]]; then
    cat "$own_ca" "$host_ca" 2>/dev/null | cmp -s - "$RUBY33_ROOT$RUBY33_CA_FILE" ||
      cat "$own_ca" "$host_ca" 2>/dev/null >"$RUBY33_ROOT$RUBY33_CA_FILE" || true
  fi
}

ruby33_ensure_packages() {
  local missing
  mapfile -t missing < <(
    for pkg in "${RUBY33_PACKAGES[@]}"; do
      [[ "$(dpkg-query --admindir="$RUBY33_ROOT/var/lib/dpkg" -W -f='${Status}' "$pkg" 2>/dev/null)" \
         == "install ok installed" ]] || echo "$pkg"
    done)
  (( ${#missing[@]} == 0 )) && return 0
  nb_log "installing into the chroot: ${missing[*]}"
  ruby33_exec env DEBIAN_FRONTEND=noninteractive sh -ec "
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends ${missing[*]} >/dev/null"
}

# --- mounting -----------------------------------------------------------------------------

# Is any process (in any mount namespace) running with its root inside DIR?
_ruby33_in_use() {
  local dir="$1" p
  for p in /proc/[0-9]*; do
    case "$(readlink "$p/root" 2>/dev/null)" in "$dir"|"$dir"/*) return 0 ;; esac
  done
  return 1
}

# Mount points below DIR in the current namespace, deepest first. (Field 5 of mountinfo
# is the mount point; octal escapes such as \040 do not occur under our paths.)
_ruby33_mounts_under() {
  awk -v d="$1/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r
}

# Unmount everything below DIR, one layer at a time (stale mounts may be stacked).
_ruby33_umount_all() {
  local target
  while target="$(_ruby33_mounts_under "$1" | head -n 1)" && [[ -n "$target" ]]; do
    umount "$target" 2>/dev/null || umount -l "$target" || nb_die "cannot unmount $target"
  done
}

# Remove mounts below the chroot left in the host namespace by an interrupted run or by the
# manual recipe, unless something is still running in there.
ruby33_clean_stale_mounts() {
  [[ -n "$(_ruby33_mounts_under "$RUBY33_ROOT")" ]] || return 0
  if _ruby33_in_use "$RUBY33_ROOT"; then
    nb_warn "mounts under $RUBY33_ROOT belong to a process still running there; leaving them"
    return 0
  fi
  nb_warn "removing stale mounts under $RUBY33_ROOT (from an interrupted run?)"
  _ruby33_umount_all "$RUBY33_ROOT"
}

_ruby33_mount() {
  _ruby33_umount_all "$RUBY33_ROOT"         # anything inherited or stale: start clean
  mkdir -p "$RUBY33_ROOT/src"
  mount --bind "$NB_REPO" "$RUBY33_ROOT/src"
  mount -t proc proc "$RUBY33_ROOT/proc"
  mount --bind /dev/pts "$RUBY33_ROOT/dev/pts"
  mount -t tmpfs -o mode=1777,size=256m tmpfs "$RUBY33_ROOT/dev/shm"
}

# Mount, run CMD in the chroot, unmount (trap: also on error or signal). Runs in a subshell
# so the trap and `set -e` state stay local. Callers choose the namespace.
_ruby33_mount_and_run() (
  trap '_ruby33_umount_all "$RUBY33_ROOT"' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM HUP
  _ruby33_mount
  local ca=""
  [[ -s "$RUBY33_ROOT$RUBY33_CA_FILE" ]] && ca="$RUBY33_CA_FILE"
  # BUNDLE_APP_CONFIG: a config dir of the chroot's own, so the repository's .bundle/config
  #   (written for Ruby 3.1; Bundler ranks it above environment variables) is not read.
  # BUNDLE_VERSION=system: use the chroot's Bundler, do not fetch the lock's (2.3.15).
  # A clean environment inside: host paths and an outer `bundle exec` mean nothing there.
  # Variables the caller wants through are listed in RUBY33_PASS_ENV (NAME=value words).
  chroot "$RUBY33_ROOT" /usr/bin/env -i \
    HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    BUNDLE_APP_CONFIG=/var/lib/neverblock/bundle-config \
    BUNDLE_PATH=/src/vendor/bundle-3.3 BUNDLE_GEMFILE=/src/gemfiles/ruby33.gemfile BUNDLE_FROZEN=true \
    BUNDLE_SILENCE_ROOT_WARNING=1 BUNDLE_JOBS="$(nproc)" \
    BUNDLE_VERSION=system \
    ${ca:+SSL_CERT_FILE="$ca"} \
    "${RUBY33_PASS_ENV[@]}" \
    /bin/sh -c 'cd /src && exec "$@"' sh "$@"
)

ruby33_exec() {
  [[ $EUID -eq 0 ]] || nb_die "the Ruby 3.3 chroot needs root (mount, chroot)"
  ruby33_built || nb_die "no Ruby 3.3 chroot at $RUBY33_ROOT; run: bin/setup --ruby 3.3"
  (( $# > 0 )) || set -- bash
  _ruby33_sync_etc
  ruby33_clean_stale_mounts
  if [[ "${NEVERBLOCK_NO_UNSHARE:-}" != 1 ]] && unshare --mount true 2>/dev/null; then
    # A new bash in a private mount namespace sources these helpers again and mounts there.
    # shellcheck disable=SC2016
    unshare --mount --propagation private -- \
      env NB_RUBY33_PASS_ENV="$(declare -p RUBY33_PASS_ENV)" \
      bash -c 'set -euo pipefail
               source "$0/common.sh"; source "$0/ruby33.sh"
               eval "$NB_RUBY33_PASS_ENV"; unset NB_RUBY33_PASS_ENV
               _ruby33_mount_and_run "$@"' "$NB_REPO/bin/lib" "$@"
  else
    # Host namespace: one chroot run at a time, so one run cannot unmount another's /src.
    (
      exec 9>"$RUBY33_LOCK.run"
      flock 9
      ruby33_clean_stale_mounts
      _ruby33_mount_and_run "$@"
    )
  fi
}

# Environment passed into the chroot (NAME=value words); callers append to it.
RUBY33_PASS_ENV=()

# Pass the host's exported variables into the chroot, so `FOO=1 bin/test --all` means the
# same on both Rubies, except those describing the host itself (paths, locale, Ruby/Bundler
# and CA settings, session variables): inside, those are set by _ruby33_mount_and_run.
RUBY33_HOST_ONLY_ENV='^(PATH|HOME|USER|LOGNAME|SHELL|PWD|OLDPWD|SHLVL|_|HOSTNAME|MAIL|TERM|TERMCAP|DISPLAY|EDITOR|VISUAL|PAGER|LS_COLORS|TMPDIR|TMP|TEMP|LANG|LANGUAGE|LC_[A-Z_]+|LD_[A-Z_]+|GEM_[A-Z_]+|RUBYOPT|RUBYLIB|RUBYSHELL|BUNDLE_[A-Z0-9_]+|BUNDLER_[A-Z_]+|SSL_CERT_[A-Z]+|[A-Z_]*CA_BUNDLE|NODE_EXTRA_CA_CERTS|XDG_[A-Z_]+|DBUS_[A-Z_]+|SSH_[A-Z_]+|DEBIAN_FRONTEND|DEBCONF_[A-Z_]+)$'
ruby33_pass_host_env() {
  local name
  for name in $(compgen -e); do
    [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ && ! "$name" =~ $RUBY33_HOST_ONLY_ENV ]] || continue
    RUBY33_PASS_ENV+=("$name=${!name}")
  done
}
