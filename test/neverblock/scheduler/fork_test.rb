# frozen_string_literal: true

require "test_helper"

# fork inside a task: the child runs detached from the parent's loop
# (lib/neverblock/scheduler/fork.rb).
class SchedulerForkTest < PlainTest
  def test_the_child_exit_status_is_its_own
    out, err, status = run_ruby(<<~RUBY)
      require "neverblock"
      NeverBlock.logger = Logger.new($stdout)
      NeverBlock.run do
        exited = Process.wait2(fork { exit 3 }).last.exitstatus
        raised = Process.wait2(fork { raise "child failed" }).last.exitstatus
        pid = fork
        if pid.nil?
          raise "blockless child failed" # ends the forking task in the child
        end
        blockless = Process.wait2(pid).last.exitstatus
        puts [exited, raised, blockless].inspect
      end
    RUBY
    assert status.success?, err
    assert_includes out, "[3, 1, 1]"
    assert_match(/blockless child failed/, out, "the blockless child's failure is logged")
  end
end
