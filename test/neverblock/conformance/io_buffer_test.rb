# frozen_string_literal: true

require_relative "conformance_helper"
require "io/nonblock"
require "tempfile"

# Reads and writes through the scheduler's IO::Buffer hooks (Scheduler#io_read
# and #io_write), which IO#read/#write and IO::Buffer#read/#write use.
class ConformanceIOBufferTest < ConformanceTest
  MESSAGE = "Hello World!"

  # Ruby's test_io_buffer_read_write, with the reader waiting first.
  def test_io_buffer_read_waits_for_io_buffer_write_from_another_fiber
    inside, outside = UNIXSocket.pair
    received = nil
    quietly_experimental do
      source = IO::Buffer.for(MESSAGE.dup)
      destination = IO::Buffer.new(source.size)
      on_scheduler_thread do
        schedule do
          destination.read(inside, source.size)
          received = destination.get_string
        end
        schedule do
          sleep 0.01
          source.write(outside, source.size)
        end
      end
    end
    assert_equal MESSAGE, received
  ensure
    inside&.close
    outside&.close
  end

  def test_a_read_gathers_chunks_written_at_different_times
    inside, outside = UNIXSocket.pair
    inside.nonblock = false
    outside.nonblock = false
    received = nil
    on_scheduler_thread do
      schedule { received = inside.read(12) }
      schedule do
        %w[Hell o\ Wo rld!].each do |chunk|
          outside.write(chunk)
          sleep 0.01
        end
      end
    end
    assert_equal MESSAGE, received
  ensure
    inside&.close
    outside&.close
  end

  # Ruby's test_timeout_after (test_io_buffer.rb).
  def test_a_timeout_interrupts_a_read_in_the_io_read_hook
    inside, outside = UNIXSocket.pair
    inside.nonblock = false
    outside.nonblock = false
    message = :unset
    error = nil
    on_scheduler_thread do
      schedule do
        Timeout.timeout(0.05) { message = inside.read(20) }
      rescue Timeout::Error => e
        error = e
      end
    end
    assert_equal :unset, message
    assert_kind_of Timeout::Error, error
  ensure
    inside&.close
    outside&.close
  end

  # Ruby's test_read_nonblock and test_write_nonblock (test_io_buffer.rb).
  def test_nonblocking_calls_return_at_once
    inside, outside = UNIXSocket.pair
    results = []
    on_scheduler_thread do
      schedule do
        results << inside.read_nonblock(20, exception: false)
        outside.write_nonblock(MESSAGE, exception: false)
        outside.close
      end
    end
    assert_equal [:wait_readable], results
    assert_equal MESSAGE, inside.read
  ensure
    inside&.close
    outside&.close unless outside&.closed?
  end

  # Ruby's test_io_buffer_pread_pwrite.
  def test_io_buffer_pwrite_then_pread_on_a_file
    requires_ruby "3.3", "IO::Buffer#pread(io, from, length) and #pwrite are Ruby 3.3's API " \
                         "(Ruby 3.1's take other arguments)"

    file = Tempfile.new("neverblock-conformance")
    received = nil
    quietly_experimental do
      source = IO::Buffer.for(MESSAGE.dup)
      destination = IO::Buffer.new(source.size)
      on_scheduler_thread do
        schedule do
          source.pwrite(file, 1, source.size)
          destination.pread(file, 1, source.size)
          received = destination.get_string
        end
      end
    end
    assert_equal MESSAGE, received
    assert_equal "\0#{MESSAGE}", File.binread(file.path)
  ensure
    file&.close!
  end

  def test_a_large_write_through_the_io_write_hook_arrives_whole
    inside, outside = UNIXSocket.pair
    inside.nonblock = false
    outside.nonblock = false
    payload = "z" * (512 * 1024)
    received = nil
    on_scheduler_thread do
      schedule { received = inside.read(payload.bytesize) }
      schedule { outside.write(payload) }
    end
    assert_equal payload.bytesize, received&.bytesize
    assert_equal payload, received
  ensure
    inside&.close
    outside&.close
  end
end
