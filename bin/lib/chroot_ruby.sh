# shellcheck shell=bash
# The Rubies that run in Debian chroots beside the system Ruby 3.1 (sourced, not executed):
#   3.3  Debian 13 (trixie), package ruby3.3          at /var/cache/neverblock/trixie
#   3.4  Debian sid with ruby3.4 from experimental    at /var/cache/neverblock/sid
#   3.4-yjit  Ruby 3.4 built with YJIT from Debian's ruby3.4 source, in the same sid chroot
#        at /opt/ruby-3.4-yjit (Debian disables YJIT only because it needs Rust); every
#        process of its passes runs with YJIT on (RUBY_YJIT_ENABLE=1)
# Recipe and rationale: /work/shared/ruby33.md. Requires common.sh to be sourced first.
#
# Defines (each acts on the Ruby chosen last with chroot_ruby_use):
#   chroot_ruby_use VERSION        choose 3.3, 3.4 or 3.4-yjit (sets CR_* below)
#   chroot_ruby_built              is the chroot there?
#   chroot_ruby_build              debootstrap the chroot if it is missing (atomic, locked)
#   chroot_ruby_ensure_packages [PKG...]  install chroot packages that are missing (e.g. a
#                                  package added to the list after the chroot was built), and
#                                  PKG (a tool one benchmark needs: bench/run instructions, valgrind)
#   chroot_ruby_exec CMD...        run CMD inside the chroot, cwd /src (the repository),
#                                  BUNDLE_PATH=vendor/bundle-X.Y, BUNDLE_GEMFILE=gemfiles/rubyXY.gemfile;
#                                  returns CMD's exit status
#   chroot_ruby_pass_host_env      pass the host's exported variables into the chroot
#
# Mounts. Each chroot_ruby_exec mounts the repository at $ROOT/src plus proc, /dev/pts and a
# /dev/shm tmpfs (and each host directory NEVERBLOCK_CHROOT_BINDS names, colon-separated, at
# the same path inside: e.g. an application outside the repository that a benchmark serves),
# runs CMD, and unmounts them from an EXIT trap. Normally this happens in
# a private mount namespace (unshare -m): the mounts are invisible to the rest of the
# machine, concurrent runs (tests + benchmarks) do not interfere, and the kernel drops them
# even if the run is killed with SIGKILL. Where unshare is unavailable (or
# NEVERBLOCK_NO_UNSHARE=1) the mounts go in the host namespace, runs are serialised with a
# lock, and the trap unmounts them. Stale mounts left by an interrupted run or by the manual
# recipe are unmounted first, provided no process is still running inside the chroot.

CR_MIRROR="${NEVERBLOCK_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# Packages every chroot needs to build the bundle's native gems.
CR_BUILD_PACKAGES=(build-essential pkg-config git ca-certificates
                   libpq-dev libmariadb-dev libyaml-dev liburing-dev)
# Libraries that examples/ load at run time: libvips for examples/thumbnails (the ruby-vips
# gem opens it through ffi, whose extension builds against libffi-dev). Debian 13 and sid
# call the package libvips42t64 (the 64-bit time_t transition); Debian 12 libvips42.
# Installed with apt by chroot_ruby_ensure_packages rather than by debootstrap, whose
# dependency resolution is rudimentary: libvips pulls in dozens of libraries.
# libcurl4t64: libcurl for the typhoeus test (ethon loads it with ffi; sid has only the
# gnutls flavour otherwise).
CR_EXAMPLE_PACKAGES=(libffi-dev libvips42t64 libcurl4t64)
# Tools the benchmarks run inside (bench/run --ruby 3.4: wrk drives bench/balance.rb, lobsters.rb ...),
# and the fleet drill's (bench/fleet.rb, test/neverblock/server/fleet_test.rb): `ip netns`,
# HAProxy and Redis (about 7 MB with their libraries, some 15 s to install once). No service
# starts in the chroot: /usr/sbin/policy-rc.d refuses (chroot_ruby_ensure_packages).
CR_BENCH_PACKAGES=(wrk iproute2 haproxy redis-server)
# Debian's Release files for sid and experimental are past their Valid-Until date on some
# mirrors (snapshots); apt refuses them unless told not to check.
CR_APT=(apt-get -o Acquire::Check-Valid-Until=false)

# chroot_ruby_use VERSION: choose the chroot later calls act on.
chroot_ruby_use() {
  CR_VERSION="$1"
  CR_BASE_RUBY=""
  case "$CR_VERSION" in
    3.3)
      CR_ROOT="${NEVERBLOCK_CR_ROOT:-/var/cache/neverblock/trixie}"
      CR_SUITE=trixie
      CR_PACKAGES=(ruby ruby-dev bundler "${CR_BUILD_PACKAGES[@]}")
      CR_RUBY=/usr/bin/ruby
      ;;
    3.4)
      CR_ROOT="${NEVERBLOCK_RUBY34_ROOT:-/var/cache/neverblock/sid}"
      CR_SUITE=sid
      # ruby3.4 itself comes from experimental (_chroot_ruby_install_experimental); sid's
      # default ruby is still 3.3.
      CR_PACKAGES=("${CR_BUILD_PACKAGES[@]}")
      CR_RUBY=/usr/bin/ruby3.4      # /usr/local/bin/ruby names it (_chroot_ruby_install_experimental)
      ;;
    3.4-yjit)
      CR_ROOT="${NEVERBLOCK_RUBY34_ROOT:-/var/cache/neverblock/sid}"
      CR_SUITE=sid
      CR_PACKAGES=("${CR_BUILD_PACKAGES[@]}" "${CR_YJIT_BUILD_PACKAGES[@]}")
      CR_RUBY="$CR_YJIT_PREFIX/bin/ruby"
      CR_BASE_RUBY=/usr/bin/ruby3.4 # the chroot's own: built = the sid chroot is there
      ;;
    *) nb_die "no chroot for Ruby $CR_VERSION (use 3.3, 3.4 or 3.4-yjit)" ;;
  esac
  CR_LOCK="${CR_ROOT}.lock"
  CR_BUNDLE_PATH="vendor/bundle-$CR_VERSION"
  local gemfile_version="${CR_VERSION%-yjit}"
  CR_GEMFILE="gemfiles/ruby${gemfile_version//./}.gemfile"
  CR_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  CR_RUBY_ENV=()
  if [[ "$CR_VERSION" == 3.4-yjit ]]; then
    CR_PATH="$CR_YJIT_PREFIX/bin:$CR_PATH"
    CR_RUBY_ENV=(RUBY_YJIT_ENABLE=1)
  fi
}

# Ruby 3.4 with YJIT: where it is installed in the sid chroot, and what building it needs
# (rustc for YJIT; the rest for Ruby's extensions). The source is Debian's ruby3.4 from
# experimental: the newest there whose source the mirror still has (3.4.11's is gone).
CR_YJIT_PREFIX=/opt/ruby-3.4-yjit
CR_YJIT_SOURCE="ruby3.4=3.4.5-1~exp1"
CR_YJIT_BUILD_PACKAGES=(autoconf bison rustc libssl-dev zlib1g-dev libgmp-dev dpkg-dev)


# Present = debootstrap finished (see chroot_ruby_build). Missing packages are added later by
# chroot_ruby_ensure_packages.
chroot_ruby_built() { [[ -x "$CR_ROOT${CR_BASE_RUBY:-$CR_RUBY}" ]]; }

# Build the chroot into "$ROOT.partial" and rename it when debootstrap succeeded, so an
# interrupted build is never mistaken for a finished one (the next run starts over).
chroot_ruby_build() {
  chroot_ruby_built && return 0
  [[ $EUID -eq 0 ]] || nb_die "building the Ruby $CR_VERSION chroot needs root"
  nb_apt_ensure debootstrap
  mkdir -p "$(dirname "$CR_ROOT")"
  (
    exec 8>"$CR_LOCK"
    flock 8                                # another setup may be building it right now
    chroot_ruby_built && exit 0
    if [[ -e "$CR_ROOT" ]]; then
      nb_die "$CR_ROOT exists but has no Ruby; remove it (rm -rf --one-file-system) to rebuild"
    fi
    local partial="$CR_ROOT.partial" log="$CR_ROOT.debootstrap.log"
    if [[ -e "$partial" ]]; then
      nb_log "removing an interrupted build at $partial"
      _chroot_ruby_umount_all "$partial"
      rm -rf --one-file-system "$partial"
    fi
    nb_log "building the Debian $CR_SUITE chroot at $CR_ROOT (log: $log)"
    local includes
    includes="$(IFS=,; echo "${CR_PACKAGES[*]}")"
    if ! debootstrap --variant=minbase --include="$includes" \
           "$CR_SUITE" "$partial" "$CR_MIRROR" >"$log" 2>&1; then
      tail -n 30 "$log" >&2
      nb_die "debootstrap failed (full log: $log)"
    fi
    if [[ "$CR_VERSION" == 3.4* ]]; then
      _chroot_ruby_install_experimental "$partial" >>"$log" 2>&1 ||
        { tail -n 30 "$log" >&2; nb_die "installing Ruby 3.4 from Debian experimental failed (full log: $log)"; }
    fi
    mv "$partial" "$CR_ROOT"
  )
}

# chroot_ruby_build_yjit: with the sid chroot there, build Ruby 3.4 with YJIT into
# CR_YJIT_PREFIX (once: minutes on two cores; locked; a marker file says it finished).
chroot_ruby_build_yjit() {
  local marker="$CR_ROOT$CR_YJIT_PREFIX/.neverblock-built"
  [[ -e "$marker" ]] && return 0
  (
    exec 8>"$CR_LOCK.yjit"
    flock 8
    [[ -e "$marker" ]] && exit 0
    local log="$CR_ROOT.yjit-build.log"
    nb_log "building Ruby 3.4 with YJIT ($CR_YJIT_SOURCE) into $CR_YJIT_PREFIX in the sid chroot (log: $log)"
    chroot_ruby_ensure_packages
    chroot_ruby_exec sh -ec "
      unset RUBY_YJIT_ENABLE # the build's own miniruby need not run with YJIT
      grep -q '^deb-src' /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null || {
        echo 'deb-src $CR_MIRROR sid main' >/etc/apt/sources.list.d/neverblock-src.list
        echo 'deb-src $CR_MIRROR experimental main' >>/etc/apt/sources.list.d/neverblock-src.list
        ${CR_APT[*]} update -qq
      }
      rm -rf /var/tmp/ruby-yjit-build $CR_YJIT_PREFIX && mkdir -p /var/tmp/ruby-yjit-build && cd /var/tmp/ruby-yjit-build
      ${CR_APT[*]} source -qq $CR_YJIT_SOURCE
      cd ruby3.4-*/
      ./configure --prefix=$CR_YJIT_PREFIX --enable-yjit --enable-shared --disable-install-doc
      make -j$(nproc)
      make install
      $CR_YJIT_PREFIX/bin/ruby --yjit -e 'exit RubyVM::YJIT.enabled? ? 0 : 1'
      SSL_CERT_FILE=$CR_CA_FILE $CR_YJIT_PREFIX/bin/gem install --no-document bundler
      cd / && rm -rf /var/tmp/ruby-yjit-build" >"$log" 2>&1 ||
      { tail -n 30 "$log" >&2; nb_die "building Ruby 3.4 with YJIT failed (full log: $log)"; }
    touch "$marker"
  )
}

# Ruby 3.4 in a sid chroot (ROOT): Debian packages it in experimental only. `ruby`, `gem`
# and friends in /usr/local/bin (first on the PATH inside) name the 3.4 binaries, since
# sid's default ruby is 3.3; Bundler comes from RubyGems, matching sid's RubyGems (Debian's
# bundle3.4 is older and warns on every start).
_chroot_ruby_install_experimental() (
  local root="$1" tool
  trap '_chroot_ruby_umount_all "$root"' EXIT
  _chroot_ruby_sync_etc "$root"
  mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
  echo "deb $CR_MIRROR experimental main" >"$root/etc/apt/sources.list.d/experimental.list"
  chroot "$root" env DEBIAN_FRONTEND=noninteractive "${CR_APT[@]}" update -qq
  chroot "$root" env DEBIAN_FRONTEND=noninteractive "${CR_APT[@]}" install -y -qq \
    --no-install-recommends -t experimental ruby3.4 ruby3.4-dev
  for tool in ruby gem irb erb rdoc ri; do
    [[ -x "$root/usr/bin/${tool}3.4" ]] && ln -sfn "/usr/bin/${tool}3.4" "$root/usr/local/bin/$tool"
  done
  chroot "$root" env SSL_CERT_FILE="$CR_CA_FILE" /usr/bin/gem3.4 install --no-document bundler
  chroot "$root" /usr/local/bin/ruby -v
)

# Keep the chroot's localhost and DNS in step with the host's, and let it trust what the
# host trusts: the chroot's own CA bundle plus the host's (which may hold a local CA, e.g.
# of an HTTPS proxy in front of rubygems.org) go into one file that SSL_CERT_FILE names.
CR_CA_FILE=/etc/ssl/neverblock-ca-certificates.crt
_chroot_ruby_sync_etc() {
  local root="${1:-$CR_ROOT}" f
  for f in /etc/hosts /etc/resolv.conf; do
    cmp -s "$f" "$root$f" || cp --remove-destination -L "$f" "$root$f"
  done
  local host_ca=/etc/ssl/certs/ca-certificates.crt own_ca="$root/etc/ssl/certs/ca-certificates.crt"
  if [[ -r "$host_ca" ]]; then
    cat "$own_ca" "$host_ca" 2>/dev/null | cmp -s - "$root$CR_CA_FILE" ||
      cat "$own_ca" "$host_ca" 2>/dev/null >"$root$CR_CA_FILE" || true
  fi
}

chroot_ruby_ensure_packages() {
  local missing
  mapfile -t missing < <(
    for pkg in "${CR_PACKAGES[@]}" "${CR_EXAMPLE_PACKAGES[@]}" "${CR_BENCH_PACKAGES[@]}" "$@"; do
      [[ "$(dpkg-query --admindir="$CR_ROOT/var/lib/dpkg" -W -f='${Status}' "$pkg" 2>/dev/null)" \
         == "install ok installed" ]] || echo "$pkg"
    done)
  (( ${#missing[@]} == 0 )) && return 0
  nb_log "installing into the chroot: ${missing[*]}"
  chroot_ruby_exec env DEBIAN_FRONTEND=noninteractive sh -ec "
    [ -e /usr/sbin/policy-rc.d ] || printf '#!/bin/sh\\nexit 101\\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    ${CR_APT[*]} update -qq
    ${CR_APT[*]} install -y -qq --no-install-recommends ${missing[*]} >/dev/null"
}

# --- mounting -----------------------------------------------------------------------------

# Is any process (in any mount namespace) running with its root inside DIR?
_chroot_ruby_in_use() {
  local dir="$1" p
  for p in /proc/[0-9]*; do
    case "$(readlink "$p/root" 2>/dev/null)" in "$dir"|"$dir"/*) return 0 ;; esac
  done
  return 1
}

# Mount points below DIR in the current namespace, deepest first. (Field 5 of mountinfo
# is the mount point; octal escapes such as \040 do not occur under our paths.)
_chroot_ruby_mounts_under() {
  awk -v d="$1/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r
}

# Unmount everything below DIR, one layer at a time (stale mounts may be stacked).
_chroot_ruby_umount_all() {
  local target
  while target="$(_chroot_ruby_mounts_under "$1" | head -n 1)" && [[ -n "$target" ]]; do
    umount "$target" 2>/dev/null || umount -l "$target" || nb_die "cannot unmount $target"
  done
}

# Remove mounts below the chroot left in the host namespace by an interrupted run or by the
# manual recipe, unless something is still running in there.
chroot_ruby_clean_stale_mounts() {
  [[ -n "$(_chroot_ruby_mounts_under "$CR_ROOT")" ]] || return 0
  if _chroot_ruby_in_use "$CR_ROOT"; then
    nb_warn "mounts under $CR_ROOT belong to a process still running there; leaving them"
    return 0
  fi
  nb_warn "removing stale mounts under $CR_ROOT (from an interrupted run?)"
  _chroot_ruby_umount_all "$CR_ROOT"
}

CR_HOST_TOOLS=(/usr/bin/prometheus /usr/bin/promtool)

_chroot_ruby_mount() {
  _chroot_ruby_umount_all "$CR_ROOT"         # anything inherited or stale: start clean
  # In a private namespace the chroot's root becomes a mount point of its own (bound onto
  # itself), as / is on a machine: `ip netns exec` (the fleet test) starts with
  # `mount --make-rslave /`, which fails on a directory that is not one.
  [[ -z "${CR_PRIVATE_NS:-}" ]] || mount --bind "$CR_ROOT" "$CR_ROOT"
  mkdir -p "$CR_ROOT/src"
  mount --bind "$NB_REPO" "$CR_ROOT/src"
  mount -t proc proc "$CR_ROOT/proc"
  mount --bind /dev/pts "$CR_ROOT/dev/pts"
  mount -t tmpfs -o mode=1777,size=256m tmpfs "$CR_ROOT/dev/shm"
  local dir
  local -a binds=()
  IFS=: read -r -a binds <<<"${NEVERBLOCK_CHROOT_BINDS:-}"
  for dir in "${binds[@]}"; do
    [[ -n "$dir" ]] || continue
    [[ "$dir" == /* && -d "$dir" ]] || nb_die "NEVERBLOCK_CHROOT_BINDS: $dir is not an absolute path of a directory"
    mkdir -p "$CR_ROOT$dir"
    mount --bind "$dir" "$CR_ROOT$dir"
  done
  # Host tools the tests run, as they are on the host (Go binaries that need only libc):
  # Debian 12's prometheus and promtool (test/neverblock/server/control_test.rb).
  local tool
  for tool in "${CR_HOST_TOOLS[@]}"; do
    [[ -x "$tool" ]] || continue
    touch "$CR_ROOT/usr/local/bin/${tool##*/}"
    mount --bind "$tool" "$CR_ROOT/usr/local/bin/${tool##*/}"
  done
}

# Mount, run CMD in the chroot, unmount (trap: also on error or signal). Runs in a subshell
# so the trap and `set -e` state stay local. Callers choose the namespace.
_chroot_ruby_mount_and_run() (
  trap '_chroot_ruby_umount_all "$CR_ROOT"' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM HUP
  _chroot_ruby_mount
  local ca=""
  [[ -s "$CR_ROOT$CR_CA_FILE" ]] && ca="$CR_CA_FILE"
  # BUNDLE_APP_CONFIG: a config dir of the chroot's own, so the repository's .bundle/config
  #   (written for Ruby 3.1; Bundler ranks it above environment variables) is not read.
  # BUNDLE_VERSION=system: use the chroot's Bundler, do not fetch the lock's (2.3.15).
  # BUNDLE_SSL_CA_CERT: Bundler 4 (Ruby 3.4's chroot) does not read SSL_CERT_FILE.
  # A clean environment inside: host paths and an outer `bundle exec` mean nothing there.
  # Variables the caller wants through are listed in CR_PASS_ENV (NAME=value words).
  chroot "$CR_ROOT" /usr/bin/env -i \
    HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
    PATH="$CR_PATH" "${CR_RUBY_ENV[@]}" \
    BUNDLE_APP_CONFIG=/var/lib/neverblock/bundle-config \
    BUNDLE_PATH="/src/$CR_BUNDLE_PATH" BUNDLE_GEMFILE="/src/$CR_GEMFILE" BUNDLE_FROZEN=true \
    BUNDLE_SILENCE_ROOT_WARNING=1 BUNDLE_JOBS="$(nproc)" \
    BUNDLE_VERSION=system \
    ${ca:+SSL_CERT_FILE="$ca"} ${ca:+BUNDLE_SSL_CA_CERT="$ca"} \
    "${CR_PASS_ENV[@]}" \
    /bin/sh -c 'cd /src && exec "$@"' sh "$@"
)

chroot_ruby_exec() {
  [[ $EUID -eq 0 ]] || nb_die "the Ruby $CR_VERSION chroot needs root (mount, chroot)"
  chroot_ruby_built || nb_die "no Ruby $CR_VERSION chroot at $CR_ROOT; run: bin/setup --ruby $CR_VERSION"
  (( $# > 0 )) || set -- bash
  _chroot_ruby_sync_etc
  chroot_ruby_clean_stale_mounts
  if [[ "${NEVERBLOCK_NO_UNSHARE:-}" != 1 ]] && unshare --mount true 2>/dev/null; then
    # A new bash in a private mount namespace sources these helpers again and mounts there.
    # shellcheck disable=SC2016
    unshare --mount --propagation private -- \
      env NB_CR_PASS_ENV="$(declare -p CR_PASS_ENV)" NB_CR_VERSION="$CR_VERSION" \
      bash -c 'set -euo pipefail
               source "$0/common.sh"; source "$0/chroot_ruby.sh"; chroot_ruby_use "$NB_CR_VERSION"
               eval "$NB_CR_PASS_ENV"; unset NB_CR_PASS_ENV NB_CR_VERSION
               CR_PRIVATE_NS=1 _chroot_ruby_mount_and_run "$@"' "$NB_REPO/bin/lib" "$@"
  else
    # Host namespace: one chroot run at a time, so one run cannot unmount another's /src.
    (
      exec 9>"$CR_LOCK.run"
      flock 9
      chroot_ruby_clean_stale_mounts
      _chroot_ruby_mount_and_run "$@"
    )
  fi
}

# Environment passed into the chroot (NAME=value words); callers append to it.
CR_PASS_ENV=()

# Pass the host's exported variables into the chroot, so `FOO=1 bin/test --all` means the
# same on both Rubies, except those describing the host itself (paths, locale, Ruby/Bundler
# and CA settings, session variables): inside, those are set by _chroot_ruby_mount_and_run.
CR_HOST_ONLY_ENV='^(PATH|HOME|USER|LOGNAME|SHELL|PWD|OLDPWD|SHLVL|_|HOSTNAME|MAIL|TERM|TERMCAP|DISPLAY|EDITOR|VISUAL|PAGER|LS_COLORS|TMPDIR|TMP|TEMP|LANG|LANGUAGE|LC_[A-Z_]+|LD_[A-Z_]+|GEM_[A-Z_]+|RUBYOPT|RUBYLIB|RUBYSHELL|BUNDLE_[A-Z0-9_]+|BUNDLER_[A-Z_]+|SSL_CERT_[A-Z]+|[A-Z_]*CA_BUNDLE|NODE_EXTRA_CA_CERTS|XDG_[A-Z_]+|DBUS_[A-Z_]+|SSH_[A-Z_]+|DEBIAN_FRONTEND|DEBCONF_[A-Z_]+)$'
chroot_ruby_pass_host_env() {
  local name
  for name in $(compgen -e); do
    [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ && ! "$name" =~ $CR_HOST_ONLY_ENV ]] || continue
    CR_PASS_ENV+=("$name=${!name}")
  done
}
