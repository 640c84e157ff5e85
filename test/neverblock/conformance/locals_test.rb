# frozen_string_literal: true

require_relative "conformance_helper"

# Fiber-local variables (Thread#[]), thread variables, and inheritable
# fiber storage (Fiber[], Ruby 3.2+) in scheduled fibers.
class ConformanceLocalsTest < ConformanceTest
  STORAGE = "fiber storage (Fiber[] and Fiber#storage) is new in Ruby 3.2"

  def test_fiber_locals_belong_to_one_fiber
    seen = {}
    on_scheduler_thread do
      Thread.current[:name] = :root
      %i[a b].each do |name|
        schedule do
          seen[[name, :at_start]] = Thread.current[:name]
          Thread.current[:name] = name
          sleep 0.01 # the other fiber sets its own value meanwhile
          seen[[name, :after_sleep]] = Thread.current[:name]
        end
      end
      seen[%i[root after]] = Thread.current[:name]
    end
    assert_equal({ %i[a at_start] => nil, %i[b at_start] => nil, %i[root after] => :root,
                   %i[a after_sleep] => :a, %i[b after_sleep] => :b }, seen)
  end

  def test_thread_variables_are_shared_by_every_fiber_of_the_thread
    seen = []
    on_scheduler_thread do
      Thread.current.thread_variable_set(:counter, 0)
      3.times do
        schedule do
          sleep 0.01
          Thread.current.thread_variable_set(:counter, Thread.current.thread_variable_get(:counter) + 1)
        end
      end
      schedule do
        sleep 0.05
        seen << Thread.current.thread_variable_get(:counter)
      end
    end
    assert_equal [3], seen
  end

  # Ruby's test_storage_inherited, through Fiber.schedule.
  def test_a_scheduled_fiber_inherits_a_copy_of_the_storage_of_its_creator
    requires_ruby "3.2", STORAGE
    seen = {}
    on_scheduler_thread do
      Fiber[:request] = :root_request
      schedule do
        seen[:child_sees] = Fiber[:request]
        Fiber[:request] = :child_request
        schedule { seen[:grandchild_sees] = Fiber[:request] }
        sleep 0.01
        seen[:child_keeps] = Fiber[:request]
      end
      seen[:root_keeps] = Fiber[:request]
    end
    assert_equal({ child_sees: :root_request, grandchild_sees: :child_request,
                   child_keeps: :child_request, root_keeps: :root_request }, seen)
  end

  def test_sibling_fibers_do_not_see_each_others_storage
    requires_ruby "3.2", STORAGE
    seen = {}
    on_scheduler_thread do
      %i[a b].each do |name|
        schedule do
          Fiber[:mine] = name
          sleep 0.01
          seen[name] = Fiber[:mine]
        end
      end
    end
    assert_equal({ a: :a, b: :b }, seen)
  end

  # Ruby's test_enumerator_inherited_storage and test_thread_inherited_storage.
  def test_enumerators_and_threads_started_in_a_fiber_inherit_its_storage
    requires_ruby "3.2", STORAGE
    seen = {}
    on_scheduler_thread do
      schedule do
        Fiber[:item] = "from the fiber"
        seen[:enumerator] = Enumerator.new { |yielder| yielder << Fiber[:item] }.next
        seen[:thread] = Thread.new { Fiber[:item] }.value
      end
    end
    assert_equal({ enumerator: "from the fiber", thread: "from the fiber" }, seen)
  end

  # NeverBlock.spawn makes a child task: like Fiber.schedule (and like a
  # child fiber, thread or enumerator), it should carry the storage of the
  # fiber that spawned it, e.g. a request id set by a server.
  def test_a_task_spawned_by_neverblock_spawn_inherits_the_spawners_storage
    requires_ruby "3.2", STORAGE
    seen = nil
    NeverBlock.run do
      Fiber[:request_id] = 42
      seen = NeverBlock.spawn { Fiber[:request_id] }.value
    end
    assert_equal 42, seen
  end
end
