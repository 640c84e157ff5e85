# frozen_string_literal: true

require_relative "conformance_helper"

# Thread::Queue and Thread::SizedQueue in scheduled fibers, between fibers of
# one loop and across threads.
class ConformanceQueueTest < ConformanceTest
  def test_fibers_pass_items_through_a_queue_until_it_is_closed
    queue = Thread::Queue.new
    received = []
    on_scheduler_thread do
      schedule do
        3.times do |item|
          queue << item
          sleep 0.01
        end
        queue.close
      end
      schedule do
        while (item = queue.pop)
          received << item
        end
      end
    end
    assert_equal [0, 1, 2], received
  end

  # Ruby's test_queue_pop_waits: a fiber blocked in pop is woken by a push
  # from a plain thread.
  def test_pop_waits_for_a_push_from_another_thread
    queue = Thread::Queue.new
    result = nil
    popper = Thread.new do
      on_scheduler_thread { schedule { result = queue.pop } }
    end
    wait_for("a fiber to wait in pop") { queue.num_waiting == 1 }
    queue << :done
    popper.join
    assert_equal :done, result
  end

  def test_items_pushed_by_several_threads_reach_fibers_on_one_loop
    queue = Thread::Queue.new
    received = []
    producers = 4.times.map do |thread|
      Thread.new { 25.times { |n| queue << [thread, n] } }
    end
    on_scheduler_thread do
      5.times do
        schedule do
          while (item = queue.pop)
            received << item
            sleep 0 # let the other consumers take turns
          end
        end
      end
      schedule do
        producers.each(&:join) # Thread#join suspends only this fiber
        queue.close
      end
    end
    assert_equal 100, received.size
    assert_equal 4.times.flat_map { |thread| 25.times.map { |n| [thread, n] } }, received.sort
  end

  def test_a_fiber_feeds_a_plain_thread_through_a_queue
    queue = Thread::Queue.new
    consumer = Thread.new do
      items = []
      while (item = queue.pop)
        items << item
      end
      items
    end
    on_scheduler_thread do
      schedule do
        5.times do |item|
          queue << item
          sleep 0.001
        end
        queue.close
      end
    end
    assert_equal [0, 1, 2, 3, 4], consumer.value
  end

  def test_closing_a_queue_wakes_every_fiber_waiting_to_pop
    queue = Thread::Queue.new
    results = []
    on_scheduler_thread do
      3.times { schedule { results << queue.pop } }
      schedule { queue.close }
    end
    assert_equal [nil, nil, nil], results
  end

  def test_pop_with_a_timeout_returns_nil_when_nothing_arrives
    requires_ruby "3.2", "Queue#pop(timeout:) is new in Ruby 3.2"
    queue = Thread::Queue.new
    result = :unset
    waited = nil
    other_fiber_ran = false
    on_scheduler_thread do
      schedule { waited = elapsed { result = queue.pop(timeout: 0.05) } }
      schedule { other_fiber_ran = true }
    end
    assert_nil result
    assert_operator waited, :>=, 0.04
    assert_operator waited, :<, 1
    assert other_fiber_ran
  end

  def test_pop_with_a_timeout_returns_an_item_that_is_already_queued
    requires_ruby "3.2", "Queue#pop(timeout:) is new in Ruby 3.2"
    queue = Thread::Queue.new
    queue << :something
    result = nil
    on_scheduler_thread { schedule { result = queue.pop(timeout: 0.0001) } }
    assert_equal :something, result
  end

  def test_pop_with_a_timeout_returns_an_item_pushed_before_the_timeout
    requires_ruby "3.2", "Queue#pop(timeout:) is new in Ruby 3.2"
    queue = Thread::Queue.new
    result = nil
    waited = nil
    on_scheduler_thread do
      schedule { waited = elapsed { result = queue.pop(timeout: 5) } }
      schedule do
        sleep 0.01
        queue << :arrived
      end
    end
    assert_equal :arrived, result
    assert_operator waited, :<, 1
  end

  def test_sized_queue_push_waits_for_room
    queue = Thread::SizedQueue.new(1)
    log = []
    on_scheduler_thread do
      schedule do
        4.times do |item|
          queue.push(item)
          log << [:pushed, item]
        end
        queue.close
      end
      schedule do
        while (item = queue.pop)
          log << [:popped, item]
          sleep 0.005
        end
      end
    end
    assert_equal [0, 1, 2, 3], log.select { |event, _| event == :popped }.map(&:last)
    ahead = 0
    log.each do |event, _|
      ahead += event == :pushed ? 1 : -1
      assert_operator ahead, :<=, 1, "a push completed while the queue was full: #{log.inspect}"
    end
  end

  def test_a_fiber_pushing_into_a_full_sized_queue_is_woken_by_a_consumer_thread
    queue = Thread::SizedQueue.new(2)
    consumer = Thread.new do
      items = []
      while (item = queue.pop)
        items << item
      end
      items
    end
    on_scheduler_thread do
      schedule do
        50.times { |item| queue.push(item) }
        queue.close
      end
    end
    assert_equal (0...50).to_a, consumer.value
  end

  def test_sized_queue_push_with_a_timeout_gives_up_when_the_queue_stays_full
    requires_ruby "3.2", "SizedQueue#push(timeout:) is new in Ruby 3.2"
    queue = Thread::SizedQueue.new(1)
    queue << :filler
    result = :unset
    waited = nil
    on_scheduler_thread { schedule { waited = elapsed { result = queue.push(:more, timeout: 0.05) } } }
    assert_nil result
    assert_operator waited, :>=, 0.04
    assert_equal 1, queue.size
  end

  def test_popping_an_empty_queue_that_nothing_can_fill_is_reported_as_a_deadlock
    out, err, status = run_script(<<~RUBY)
      require "neverblock"
      Thread.new do
        Fiber.set_scheduler(NeverBlock::Scheduler.new)
        Fiber.schedule do
          puts "waiting"
          Thread::Queue.new.pop
        end
      end.join
    RUBY
    assert_equal "waiting\n", out
    assert_match(/No live threads left\. Deadlock\?/, err)
    refute_predicate status, :success?
  end
end
