# shellcheck shell=bash
# Ruby's own test/fiber suite, run against NeverBlock::Scheduler (sourced, not executed).
# Requires common.sh and chroot_ruby.sh to be sourced first.
#
# Defines:
#   fiber_suite_run RUBY MIN [RUNNER_OPTION...]
#       fetches the Ruby source that Debian packages for RUBY (3.1 on the host, 3.3 and 3.4
#       in their chroots), rewrites its test/fiber/scheduler.rb so that the reference `Scheduler`
#       becomes `class Scheduler < NeverBlock::Scheduler` (the file's helper subclasses,
#       IOBufferScheduler, BrokenUnblockScheduler, ..., then subclass NeverBlock's), runs
#       the suite with Ruby's own runner (tool/test/runner.rb), prints the score and the
#       failing tests, and fails when fewer than MIN tests pass (MIN empty: all but one,
#       the reference-specific test that reads the reference's `waiting` attribute).
#
# Nothing of Ruby's is committed: the source tarball comes from Debian's mirror at run time
# into tmp/fiber-suite/ (ignored by git, and visible in the chroots as /src/tmp/...).

FIBER_SUITE_MIRROR="${NEVERBLOCK_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
FIBER_SUITE_DIR="$NB_REPO/tmp/fiber-suite"

# The Debian version of package rubyX.Y for RUBY, read from the dpkg database of the host
# or of the chroot that runs that Ruby.
_fiber_suite_debian_version() {
  local ruby="$1" admindir=/var/lib/dpkg
  case "$ruby" in
    3.1) ;;
    # 3.4-yjit: built from Debian's ruby3.4 source in the sid chroot, whose package says the series.
    3.3|3.4|3.4-yjit) chroot_ruby_use "$ruby"; admindir="$CR_ROOT/var/lib/dpkg"; ruby="${ruby%-yjit}" ;;
    *)   nb_warn "fiber suite: unsupported Ruby $ruby"; return 1 ;;
  esac
  dpkg-query --admindir="$admindir" -W -f='${Version}' "ruby$ruby" 2>/dev/null ||
    { nb_warn "fiber suite: package ruby$ruby is not installed (run bin/setup --ruby $ruby)"; return 1; }
}

# The upstream versions of rubyX.Y whose source Debian lists (unstable, experimental),
# newest first.
_fiber_suite_listed_versions() {
  local ruby="$1" suite
  for suite in sid experimental; do
    curl -sSfL "$FIBER_SUITE_MIRROR/dists/$suite/main/source/Sources.xz" 2>/dev/null | xz -dc 2>/dev/null |
      awk -v pkg="ruby$ruby" '/^Package: / { p = ($2 == pkg) } p && /^Version: / { print $2 }'
  done | sed -e 's/^[0-9]*://' -e 's/-[^-]*$//' | sort -Vru
}

# Downloads Debian's upstream tarball of Ruby UPSTREAM (package rubyX.Y) to FILE.
_fiber_suite_download() {
  local ruby="$1" upstream="$2" file="$3" ext
  for ext in xz gz bz2; do
    if curl -sSfL -o "$file.partial" \
         "$FIBER_SUITE_MIRROR/pool/main/r/ruby$ruby/ruby${ruby}_${upstream}.orig.tar.$ext" 2>/dev/null; then
      mv "$file.partial" "$file"
      return 0
    fi
  done
  rm -f "$file.partial"
  return 1
}

# Downloads and unpacks test/fiber and the test runner (tool/) of Debian's upstream
# tarball for RUBY into $FIBER_SUITE_DIR/<upstream version>/ruby; prints that directory.
# When the mirror lacks the installed version's source (seen for 3.4.11, packaged in
# experimental), the newest release of the same series whose source it has is used, and
# the run says so.
_fiber_suite_fetch() {
  local ruby="$1" version upstream dir tarball candidate
  version="$(_fiber_suite_debian_version "$ruby")" || return 1
  ruby="${ruby%-yjit}"              # the package the source comes from
  upstream="${version#*:}"          # no epoch
  upstream="${upstream%-*}"         # no Debian revision
  for candidate in "$upstream" $(_fiber_suite_listed_versions "$ruby"); do
    dir="$FIBER_SUITE_DIR/$candidate"
    [[ -f "$dir/ruby/tool/test/runner.rb" ]] && break
    mkdir -p "$dir"
    tarball="$dir/ruby.orig.tar"
    if _fiber_suite_download "$ruby" "$candidate" "$tarball"; then
      rm -rf "$dir/ruby" && mkdir -p "$dir/ruby"
      tar -xf "$tarball" -C "$dir/ruby" --strip-components=1 --wildcards \
        '*/test/fiber/*' '*/tool/lib/*' '*/tool/test/*' ||
        { nb_warn "fiber suite: $tarball has no test/fiber or tool/test"; return 1; }
      rm -f "$tarball"
      break
    fi
    rmdir "$dir" 2>/dev/null || true
  done
  if [[ ! -f "$dir/ruby/tool/test/runner.rb" ]]; then
    nb_warn "fiber suite: cannot download the source of Ruby $upstream (or another $ruby release) from $FIBER_SUITE_MIRROR"
    return 1
  fi
  [[ "$candidate" == "$upstream" ]] ||
    nb_warn "fiber suite: the mirror has no source of Ruby $upstream; running Ruby $candidate's test/fiber on it"
  printf '%s\n' "$dir/ruby"
}

# Copies test/fiber to DEST with the reference Scheduler replaced by NeverBlock's.
_fiber_suite_prepare() {
  local src="$1" dest="$2"
  rm -rf "$dest"
  cp -r "$src/test/fiber" "$dest"
  local file="$dest/scheduler.rb"
  if [[ "$(grep -c '^class Scheduler[[:space:]]*$' "$file")" != 1 ]]; then
    nb_warn "fiber suite: $src/test/fiber/scheduler.rb no longer defines 'class Scheduler' on a line of its own"
    return 1
  fi
  # The reference class stays loadable under another name; `Scheduler` is ours.
  sed -i 's/^class Scheduler[[:space:]]*$/class ReferenceScheduler/' "$file"
  sed -i '1a require "neverblock"\nclass Scheduler < NeverBlock::Scheduler; end' "$file"
}

# _fiber_suite_stacks SUITE: each thread's C stack (gdb) in the Ruby process still running
# SUITE (a chroot's process is read through /proc/PID/root).
_fiber_suite_stacks() {
  command -v gdb >/dev/null || { echo "(gdb is not installed: no stacks)"; return 0; }
  local watcher pid
  # (Ruby's runner sets $0 to each test's name: the Ruby is found as timeout(1)'s child.)
  for watcher in $(pgrep -f -- "^timeout .*runner.rb -v .*$1" || true); do
  for pid in $(pgrep -P "$watcher" || true); do
    echo "--- process $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-160)"
    timeout 60 gdb -batch -nx -iex "set sysroot /proc/$pid/root" -ex "attach $pid" \
      -ex "thread apply all bt 25" "$(readlink "/proc/$pid/exe")" 2>&1 | grep -E '^(Thread |#[0-9])' | head -n 250 || true
  done
  done
}

# _fiber_suite_attempt RUBY LIMIT SUITE LOG COMMAND...: one run of the suite into LOG; shortly
# before LIMIT (15 s, or a third of it), the stacks of what still runs go to LOG.stacks. Returns the command's status.
_fiber_suite_attempt() {
  local ruby="$1" limit="$2" suite="$3" log="$4" status; shift 4
  rm -f "$log.stacks"
  ( sleep "$(( limit - (limit > 45 ? 15 : limit / 3) ))" && _fiber_suite_stacks "$suite" >"$log.stacks" 2>&1 ) &
  local watcher=$!
  set +e
  case "$ruby" in
    3.1) ( cd "$NB_REPO" && nb_host_bundle_env && "$@" ) >"$log" 2>&1 ;;
    *)   chroot_ruby_use "$ruby"; chroot_ruby_exec "$@" >"$log" 2>&1 ;;
  esac
  status=$?
  set -e
  kill "$watcher" 2>/dev/null || true
  wait "$watcher" 2>/dev/null || true
  return "$status"
}

fiber_suite_run() {
  local ruby="$1" min="$2"; shift 2
  local src suite log status=0
  # One download at a time (bin/test --jobs runs passes at once); each pass (Ruby and
  # selector) gets its own copy of the suite and its own log.
  mkdir -p "$FIBER_SUITE_DIR"
  src="$(exec 9>"$FIBER_SUITE_DIR/.fetch.lock"; flock 9; _fiber_suite_fetch "$ruby")" || return 1
  local pass="$ruby-${NEVERBLOCK_SELECTOR:-epoll}"
  suite="$(dirname "$src")/fiber-neverblock-$pass"
  _fiber_suite_prepare "$src" "$suite" || return 1
  log="$(dirname "$src")/last-run-$pass.log"

  # Paths as the Ruby under test sees them: the repository is /src inside a chroot.
  local root="$NB_REPO"
  [[ "$ruby" == 3.1 ]] || root=/src
  local rel_src="${src#"$NB_REPO"/}" rel_suite="${suite#"$NB_REPO"/}"
  # A hung suite fails after NEVERBLOCK_FIBER_SUITE_TIMEOUT seconds (default 150; it takes
  # 10-30). -v logs each test as it starts, so the log's tail names the one that hung.
  local limit="${NEVERBLOCK_FIBER_SUITE_TIMEOUT:-150}"
  local command=(timeout --kill-after=10 "$limit"
                 bundle exec ruby -I "$root/lib" -I "$root/$rel_src/tool/lib"
                 "$root/$rel_src/tool/test/runner.rb" -v "$@" "$root/$rel_suite")
  nb_log "Ruby's own test/fiber suite ($(basename "$(dirname "$src")")) on Ruby $ruby with NeverBlock::Scheduler"
  local attempt
  for attempt in 1 2; do
    _fiber_suite_attempt "$ruby" "$limit" "$rel_suite" "$log" "${command[@]}" && status=0 || status=$?
    # Only a hang is run again, its stacks printed first; a second hang fails the pass.
    # (Seen in three CI runs: Ruby 3.4, select selector, the GC-stress test, whose fiber
    # waited on /dev/null through select; such waits no longer reach the selector.)
    (( status == 124 || status == 137 )) || break
    nb_warn "fiber suite on Ruby $ruby hung (exit $status); the test it was in, then each thread's C stack:"
    tail -n 3 "$log" | cut -c1-200 >&2
    cat "$log.stacks" >&2 2>/dev/null || true
    (( attempt == 1 )) || break
    nb_warn "running the fiber suite on Ruby $ruby once more"
  done

  # Ruby's runner ends with "N tests, A assertions, F failures, E errors, S skips".
  local summary total failures errors skips passed
  # (|| true: with no summary, grep's status would end the caller's errexit subshell here,
  # silently, before the log's tail below says where the suite stopped.)
  summary="$(grep -E '^[0-9]+ tests, [0-9]+ assertions, [0-9]+ failures, [0-9]+ errors, [0-9]+ skips' "$log" | tail -n 1 || true)"
  if [[ -z "$summary" ]]; then
    tail -n 40 "$log" >&2
    nb_warn "fiber suite on Ruby $ruby did not finish (exit $status; full log: $log)"
    return 1
  fi
  [[ "$summary" =~ ^([0-9]+)\ tests,\ [0-9]+\ assertions,\ ([0-9]+)\ failures,\ ([0-9]+)\ errors,\ ([0-9]+)\ skips ]]
  total="${BASH_REMATCH[1]}" failures="${BASH_REMATCH[2]}" errors="${BASH_REMATCH[3]}" skips="${BASH_REMATCH[4]}"
  passed=$(( total - failures - errors - skips ))
  [[ -n "$min" ]] || min=$(( total - 1 ))
  # Each failure is reported as "  N) Failure:" or "  N) Error:" followed by "Class#test ...".
  awk '/^ +[0-9]+\) (Failure|Error):/ { getline name; sub(/ \[.*/, "", name); sub(/:$/, "", name); print "    " $2 " " name }' "$log" >&2
  if (( passed >= min )); then
    nb_log "Ruby $ruby: Ruby's test/fiber suite: $passed/$total passed (at least $min required)"
  else
    nb_warn "Ruby $ruby: Ruby's test/fiber suite: $passed/$total passed, fewer than the $min required (log: $log)"
    return 1
  fi
}
