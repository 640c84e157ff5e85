# frozen_string_literal: true

require_relative "conformance_helper"

# External enumeration (Enumerator#next, which runs the enumerator in a
# fiber of its own) inside scheduled fibers.
class ConformanceEnumeratorTest < ConformanceTest
  RUBY_31_ENUMERATOR = "Ruby 3.1 runs Enumerator#next in a blocking fiber, so a wait inside it " \
                       "blocks the whole thread and nothing can write (Ruby's reference scheduler hangs too)"

  # Ruby's test_read_characters: the enumerator is made outside the fiber.
  def test_next_over_a_socket_that_another_fiber_writes
    requires_ruby "3.2", RUBY_31_ENUMERATOR
    inside, outside = UNIXSocket.pair
    characters = +""
    on_scheduler_thread do
      enumerator = inside.to_enum(:each_char)
      schedule do
        sleep 0.01 # the reader gets to wait first
        outside.write("Hello World")
        outside.close
      end
      schedule do
        loop { characters << enumerator.next } # loop ends on StopIteration
        inside.close
      end
    end
    assert_equal "Hello World", characters
  ensure
    inside&.close unless inside&.closed?
    outside&.close unless outside&.closed?
  end

  def test_next_over_a_socket_with_an_enumerator_made_inside_the_fiber
    requires_ruby "3.2", RUBY_31_ENUMERATOR
    inside, outside = UNIXSocket.pair
    lines = []
    on_scheduler_thread do
      schedule do
        enumerator = inside.each_line
        lines << enumerator.next << enumerator.next
      end
      schedule do
        outside.write("first\n")
        sleep 0.01
        outside.write("second\n")
      end
    end
    assert_equal ["first\n", "second\n"], lines
  ensure
    inside&.close
    outside&.close
  end

  def test_next_over_a_socket_whose_data_is_already_there
    inside, outside = UNIXSocket.pair
    outside.write("abc")
    outside.close
    characters = []
    on_scheduler_thread do
      schedule do
        enumerator = inside.each_char
        loop { characters << enumerator.next }
      end
    end
    assert_equal %w[a b c], characters
  ensure
    inside&.close
    outside&.close unless outside&.closed?
  end

  def test_an_enumerator_that_sleeps_lets_other_fibers_run
    requires_ruby "3.2", RUBY_31_ENUMERATOR
    events = []
    on_scheduler_thread do
      schedule do
        enumerator = Enumerator.new do |yielder|
          sleep 0.02
          yielder << :from_enumerator
        end
        events << enumerator.next
      end
      schedule { events << :other_fiber }
    end
    assert_equal %i[other_fiber from_enumerator], events
  end

  def test_an_enumerator_fed_by_a_queue_from_another_thread
    queue = Thread::Queue.new
    producer = Thread.new { 3.times { |n| queue << n } }
    values = []
    on_scheduler_thread do
      schedule do
        enumerator = Enumerator.new { |yielder| loop { yielder << queue.pop } }
        3.times { values << enumerator.next }
      end
    end
    assert_equal [0, 1, 2], values
  ensure
    producer&.join
  end

  def test_stop_iteration_carries_the_result_of_the_enumeration
    result = nil
    on_scheduler_thread do
      schedule do
        enumerator = Enumerator.new do |yielder|
          yielder << 1
          :finished
        end
        enumerator.next
        begin
          enumerator.next
        rescue StopIteration => e
          result = e.result
        end
      end
    end
    assert_equal :finished, result
  end
end
