# frozen_string_literal: true

require "test_helper"
require "io/wait"
require "tempfile"

# A wait on a regular file or on /dev/null returns at once, in the fiber
# that waits: Ruby waits on such files too (RubyVM::InstructionSequence.
# compile_file does), and a turn through the selector could hold the fiber
# for as long as the selector takes to say what is always true (the select
# selector under GC.stress, on Ruby 3.4: a minute).
class SchedulerAlwaysReadyFilesTest < NeverBlockTest
  def test_a_wait_on_a_regular_file_or_dev_null_does_not_leave_the_fiber
    null = File.open(File::NULL)
    Tempfile.create("neverblock") do |file|
      file.write("data")
      file.flush
      [file, null].each do |io|
        others_ran = false
        NeverBlock.spawn do # runs to its first wait at once, then waits for a turn of the loop
          NeverBlock.sleep(0)
          others_ran = true
        end
        assert io.wait_readable(5), io.path
        refute others_ran, "waiting on #{io.path} let another fiber run: it went through the selector"
        NeverBlock.sleep(0.01) # (the other fiber runs now)
        assert others_ran
      end
    end
  ensure
    null&.close
  end

  # /proc and /sys report a change as IO::PRIORITY on a regular file (a
  # mount, a cgroup event, a GPIO pin): such a wait is not ready at once.
  def test_a_wait_for_priority_on_a_regular_file_waits
    path = "/proc/self/mountinfo"
    skip "no #{path} here" unless File.exist?(path)

    File.open(path) do |io|
      ticks = 0
      ticker = NeverBlock.spawn { loop { ticks += 1; NeverBlock.sleep(0.01) } }
      refute io.wait_priority(0.2), "a mount table that did not change was reported changed"
      assert_operator ticks, :>=, 3, "the loop was held while it waited"
    ensure
      ticker&.cancel
    end
  end

  def test_a_pipe_still_waits_in_the_selector
    reader, writer = IO.pipe
    waiting = NeverBlock.spawn { reader.wait_readable(5) }
    NeverBlock.sleep(0.01)
    refute waiting.finished?, "a wait on an empty pipe returned"
    writer.write("x")
    assert waiting.value, "the pipe turned readable"
  ensure
    [reader, writer].each { |io| io&.close }
  end
end
