# frozen_string_literal: true

require "fileutils"
require "shellwords"
require "tmpdir"

# Child processes that prove they ran at the same time, without a clock:
# each child marks that it has started, then waits until all `count`
# children have started, and only then ends, leaving its verdict
# ("together") in a file. Children run one after the other never meet: the
# first one waits alone until a deadline and leaves "alone" instead. So a
# test asserts the concurrency itself (#together? for every child), which a
# loaded machine cannot break (it only makes the children start later), where
# a limit on the wall time of the calls failed at load 8.
#
#   rendezvous = ChildRendezvous.new(3)
#   3.times.map { |i| NeverBlock.spawn { system(rendezvous.shell(i)) } }.each(&:wait)
#   assert rendezvous.all_together?, rendezvous.verdicts.inspect
#   rendezvous.close
#
# A child that leaves alone exits 1 (`system` returns false); one that met
# the others exits `exit_status`.
class ChildRendezvous
  # Seconds a child waits for the others before it gives up: far beyond how
  # long a loaded machine takes to start a few children at once, short
  # enough that calls made one after the other fail in one such wait (the
  # first child's; later ones find the deadline passed).
  LIMIT = 20

  # Seconds between a waiting child's looks at the others (each look is a
  # shell glob; the pause is a `sleep` process).
  POLL = 0.05

  # What each child runs: $1 the directory, $2 how many, $3 the deadline
  # (Unix seconds), $4 its name, $5 seconds to sleep first, $6 its exit
  # status, $7 what it prints.
  SCRIPT = <<~'SH'
    dir=$1 count=$2 deadline=$3 name=$4
    : > "$dir/started.$name"
    [ "$5" = 0 ] || sleep "$5"
    while :; do
      set -- "$dir"/started.*
      [ "$#" -ge "$count" ] && break
      if [ "$(date +%s)" -ge "$deadline" ]; then echo alone > "$dir/verdict.$name"; exit 1; fi
      sleep POLL
    done
    echo together > "$dir/verdict.$name"
  SH

  # @return [Integer] how many children meet.
  attr_reader :count

  # @param count [Integer] children that must all have started before any ends.
  # @param limit [Numeric] seconds a child waits for the others.
  def initialize(count, limit: LIMIT)
    @count = count
    @dir = Dir.mktmpdir("neverblock-rendezvous")
    @deadline = Time.now.to_i + limit.ceil
  end

  # The child's command, as an argv (Process.spawn, Open3, IO.popen).
  # @param name [#to_s] the child's name among the others (its index).
  # @param sleep [Numeric] seconds the child sleeps after it has started
  #   (a call that takes a while, as a slow child's would).
  # @param exit_status [Integer] its exit status when it met the others.
  # @param output [String, nil] what it prints to stdout when done.
  # @return [Array<String>]
  def argv(name, sleep: 0, exit_status: 0, output: nil)
    script = SCRIPT.sub("sleep POLL", "sleep #{POLL}")
    script += "printf '%s\\n' #{Shellwords.escape(output)}\n" if output
    script += "exit #{Integer(exit_status)}\n"
    ["sh", "-c", script, "child", @dir, @count.to_s, @deadline.to_s, name.to_s, sleep.to_s]
  end

  # The same command as one shell line (`system`, backticks).
  # @return [String]
  def shell(name, **options)
    Shellwords.join(argv(name, **options))
  end

  # This process takes part under `name`, as a child that has started (and
  # does not wait): the children wait for it too.
  # @return [void]
  def arrive(name)
    File.write(File.join(@dir, "started.#{name}"), "")
  end

  # @return [Hash{String => String}] each child's verdict, by name:
  #   "together", "alone", or "none" for a child that has not ended.
  def verdicts
    Dir.children(@dir).grep(/\Astarted\./).sort.to_h do |marker|
      name = marker.delete_prefix("started.")
      verdict = File.join(@dir, "verdict.#{name}")
      [name, File.exist?(verdict) ? File.read(verdict).strip : "none"]
    end
  end

  # @return [Boolean] every one of the `count` children has met all the others.
  def all_together?
    verdicts.values.count("together") == @count
  end

  # Removes the children's files.
  # @return [void]
  def close
    FileUtils.rm_rf(@dir)
  end
end
