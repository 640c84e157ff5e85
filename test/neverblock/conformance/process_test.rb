# frozen_string_literal: true

require_relative "conformance_helper"

# Child processes from scheduled fibers (Scheduler#process_wait): spawn,
# Process.wait, system, backticks, and fork.
class ConformanceProcessTest < ConformanceTest
  # Ruby's test_process_wait.
  def test_process_wait_for_a_spawned_child
    status = nil
    on_scheduler_thread do
      schedule do
        pid = Process.spawn("true")
        Process.wait(pid)
        status = [$?.pid == pid, $?.success?]
      end
    end
    assert_equal [true, true], status
  end

  # Ruby's test_system.
  def test_system_reports_the_exit_status
    results = []
    on_scheduler_thread do
      schedule do
        results << system("true") << $?.success?
        results << system("exit 3") << $?.exitstatus
      end
    end
    assert_equal [true, true, false, 3], results
  end

  # Ruby's test_backquote.
  def test_backticks_capture_the_output
    output = nil
    on_scheduler_thread do
      schedule { output = `#{RbConfig.ruby} -e "sleep 0.05; puts %[ok]"` }
    end
    assert_equal "ok\n", output
  end

  # Each child waits until all five have started (ChildRendezvous): waited
  # for one after the other, the first would wait alone. No clock involved,
  # so a loaded machine cannot fail it.
  def test_children_waited_for_by_different_fibers_run_at_the_same_time
    rendezvous = ChildRendezvous.new(5)
    results = []
    on_scheduler_thread(limit: ChildRendezvous::LIMIT + HANG_LIMIT) do
      3.times { |index| schedule { results << system(rendezvous.shell("system-#{index}")) } }
      2.times { |index| schedule { results << `#{rendezvous.shell("backticks-#{index}", output: "done")}` } }
    end
    assert rendezvous.all_together?, "the children did not all run at once: #{rendezvous.verdicts}"
    assert_equal 3, results.count(true)
    assert_equal 2, results.count("done\n")
  ensure
    rendezvous&.close
  end

  # The child ends only once the other fiber has run: a loop held while the
  # child is waited for would leave it waiting alone until its deadline.
  def test_waiting_for_a_child_does_not_hold_up_other_fibers
    rendezvous = ChildRendezvous.new(2)
    events = []
    on_scheduler_thread(limit: ChildRendezvous::LIMIT + HANG_LIMIT) do
      schedule do
        events << [:child_exited, system(rendezvous.shell("child"))]
      end
      schedule do
        sleep 0.02
        events << :other_fiber_ran
        rendezvous.arrive("fiber")
      end
    end
    assert_equal [:other_fiber_ran, [:child_exited, true]], events
  ensure
    rendezvous&.close
  end

  # Ruby's test_fork (newest form): wait from a fiber for a child forked
  # before the loop started.
  def test_wait_for_a_child_forked_before_the_loop
    pid = Process.spawn("true")
    status = nil
    on_scheduler_thread do
      schedule do
        Process.wait(pid)
        status = $?
      end
    end
    assert_equal pid, status.pid
    assert_predicate status, :success?
  end

  def test_wait_for_any_child
    result = nil
    on_scheduler_thread do
      schedule do
        pid = Process.spawn("exit 7")
        waited_pid, status = Process.wait2(-1)
        result = [waited_pid == pid, status.exitstatus]
      end
    end
    assert_equal [true, 7], result
  end

  def test_wait_with_wnohang_returns_nil_while_the_child_runs
    results = []
    on_scheduler_thread do
      schedule do
        pid = Process.spawn("sleep 0.1")
        results << Process.wait(pid, Process::WNOHANG)
        results << (Process.wait(pid) == pid)
      end
    end
    assert_equal [nil, true], results
  end

  # IO#close of a popen'd IO waits for its child; when Process.wait took
  # the child first, plain Ruby's close returns normally (waitpid: ECHILD).
  def test_closing_a_popen_io_whose_child_was_already_reaped
    results = []
    on_scheduler_thread do
      schedule do
        io = IO.popen(["echo", "out"])
        results << io.read
        Process.wait(io.pid)
        results << $?.success?
        results << io.close << io.closed?
      end
    end
    assert_equal ["out\n", true, nil, true], results
  end

  def test_waiting_again_for_a_reaped_child_raises_echild_as_ruby_does
    pid = Process.spawn("true")
    Process.wait(pid)
    error = nil
    on_scheduler_thread do
      schedule do
        Process.wait(pid)
      rescue SystemCallError => e
        error = e
      end
    end
    assert_instance_of Errno::ECHILD, error
  end

  # --- fork ---------------------------------------------------------------
  # In child processes, so that the child's exit (which closes the
  # scheduler it inherited) happens as in a real program.

  # Ruby's test_fork: `fork {}` in a scheduled fiber, then wait for it.
  def test_a_child_forked_in_a_scheduled_fiber_exits_cleanly
    out, err, status = run_script(<<~RUBY)
      require "neverblock"
      Thread.new do
        Fiber.set_scheduler(NeverBlock::Scheduler.new)
        Fiber.schedule do
          pid = fork {}
          Process.wait(pid)
          puts "child exit status: \#{$?.exitstatus}"
        end
      end.join
    RUBY
    assert_equal "", err
    assert_equal "child exit status: 0\n", out
    assert_predicate status, :success?
  end

  # The child answers only once the parent's other fiber has run (a pipe
  # says so, not a sleep): a parent whose read of the child held the thread
  # would print in the wrong order, after the child's 10 s wait.
  def test_a_child_forked_in_a_scheduled_fiber_works_while_the_parent_carries_on
    out, err, status = run_script(<<~RUBY)
      require "neverblock"
      $stdout.sync = true
      reader, writer = IO.pipe
      carried_on, carrying_on = IO.pipe
      Thread.new do
        Fiber.set_scheduler(NeverBlock::Scheduler.new)
        Fiber.schedule do
          pid = fork do
            reader.close
            IO.select([carried_on], nil, nil, 10) # the parent's other fiber prints meanwhile
            writer.write("made by the child")
            writer.close
          end
          writer.close
          data = reader.read
          Process.wait(pid)
          puts "child sent: \#{data}; exit status: \#{$?.exitstatus}"
        end
        Fiber.schedule do
          puts "parent carried on"
          carrying_on.write("!")
        end
      end.join
    RUBY
    assert_equal "", err
    assert_equal "parent carried on\nchild sent: made by the child; exit status: 0\n", out
    assert_predicate status, :success?
  end

  def test_a_child_forked_in_a_task_exits_cleanly
    out, err, status = run_script(<<~RUBY)
      require "neverblock"
      NeverBlock.run do
        pid = fork { puts "child ran" }
        Process.wait(pid)
        puts "child exit status: \#{$?.exitstatus}"
      end
    RUBY
    assert_equal "", err
    assert_equal "child ran\nchild exit status: 0\n", out
    assert_predicate status, :success?
  end

  # Ruby's test_post_fork_* tests fork from the blocking root fiber while a
  # scheduler is set.
  def test_a_child_forked_from_the_root_fiber_of_a_scheduler_thread_exits_cleanly
    out, err, status = run_script(<<~RUBY)
      require "neverblock"
      Thread.new do
        Fiber.set_scheduler(NeverBlock::Scheduler.new)
        pid = fork { puts "child: blocking=\#{Fiber.current.blocking?}" }
        Process.wait(pid)
        puts "child exit status: \#{$?.exitstatus}"
      end.join
    RUBY
    assert_equal "", err
    assert_equal "child: blocking=true\nchild exit status: 0\n", out
    assert_predicate status, :success?
  end
end
