# shellcheck shell=bash
# Shared helpers for bin/setup, bin/test, bin/ruby33 (sourced, not executed).
#
# Defines:
#   NB_REPO                 absolute path of the repository
#   nb_log / nb_warn / nb_die
#   nb_apt_ensure PKG...    install Debian packages that are missing (root only)
#   nb_host_bundle_env      export the Bundler settings used for the system Ruby (3.1)
#   NB_URING_PROBE          Ruby snippet that reports io-event's URing selector

NB_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# Colour only on a terminal (CI logs stay plain).
if [[ -t 2 ]]; then _nb_c() { printf '\033[1;%sm%s\033[0m' "$1" "$2"; }; else _nb_c() { printf '%s' "$2"; }; fi
nb_log()  { printf '%s %s\n' "$(_nb_c 34 '==>')" "$*" >&2; }
nb_warn() { printf '%s %s\n' "$(_nb_c 33 'warning:')" "$*" >&2; }
nb_die()  { printf '%s %s\n' "$(_nb_c 31 'error:')" "$*" >&2; exit 1; }

# Ruby without a locale falls back to US-ASCII; fix the encoding for every run.
export LANG="${LANG:-C.UTF-8}"

# Run a command and print how long it took. (No `cmd || ...` here: that would switch off
# `set -e` inside cmd.)
nb_timed() {
  local start=$SECONDS
  "$@"
  nb_log "$* done in $(( SECONDS - start ))s"
}

# nb_apt_missing PKG... -> prints the packages that are not installed.
nb_apt_missing() {
  local pkg
  for pkg in "$@"; do
    # "install ok installed" is dpkg's status for a fully installed package.
    if [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" != "install ok installed" ]]; then
      printf '%s\n' "$pkg"
    fi
  done
}

# nb_apt_ensure PKG... -> installs what is missing; runs `apt-get update` at most once
# per process and only when something has to be installed.
NB_APT_UPDATED=${NB_APT_UPDATED:-}
nb_apt_ensure() {
  local missing
  mapfile -t missing < <(nb_apt_missing "$@")
  (( ${#missing[@]} == 0 )) && return 0

  [[ $EUID -eq 0 ]] || nb_die "missing Debian packages (${missing[*]}); run bin/setup as root"
  nb_log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes
  if [[ -z "$NB_APT_UPDATED" ]]; then
    apt-get update -qq
    NB_APT_UPDATED=1
  fi
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Bundler settings for the system Ruby. The repository's .bundle/config is git-ignored,
# so everything is passed through the environment. FROZEN makes a Gemfile/Gemfile.lock
# mismatch an error instead of a silent re-resolve.
nb_host_bundle_env() {
  # Drop anything an outer `bundle exec` may have left behind.
  unset RUBYOPT RUBYLIB GEM_HOME GEM_PATH BUNDLE_BIN_PATH BUNDLER_ORIG_PATH BUNDLER_SETUP
  export BUNDLE_GEMFILE="$NB_REPO/Gemfile"
  export BUNDLE_PATH="vendor/bundle"        # relative to the Gemfile's directory
  export BUNDLE_FROZEN=true
  export BUNDLE_SILENCE_ROOT_WARNING=1
  export BUNDLE_JOBS="${BUNDLE_JOBS:-$(nproc)}"
}

# Prints "compiled=<bool> works=<bool> io_event_default=<Selector> [error]".
#   compiled: io-event was built against liburing (IO::Event::Selector::URing exists)
#   works:    an io_uring ring can be created and a pipe read through it on this kernel
# shellcheck disable=SC2016,SC2034  # single-quoted Ruby; used by bin/setup
NB_URING_PROBE='
require "io/event"
compiled = IO::Event::Selector.const_defined?(:URing)
works = false
error = nil
if compiled
  begin
    selector = IO::Event::Selector::URing.new(Fiber.current)
    r, w = IO.pipe
    reader = Fiber.new { selector.io_wait(Fiber.current, r, IO::READABLE) }
    reader.transfer                                  # parks in io_wait
    w.write("x")
    selector.select(1)                               # completion resumes the reader
    works = !reader.alive?
    selector.close
  rescue => e
    error = "#{e.class}: #{e.message}"
  end
end
puts ["compiled=#{compiled}", "works=#{works}",
      "io_event_default=#{IO::Event::Selector.default.name.split("::").last}", error].compact.join(" ")
'
