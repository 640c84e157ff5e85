# frozen_string_literal: true

require_relative "conformance_helper"
require "digest"
require "io/nonblock"
require "io/wait"

# Pipes and sockets in scheduled fibers (Scheduler#io_wait, #io_read,
# #io_write, #io_select): a fiber waiting for IO lets the others run.
class ConformanceIOTest < ConformanceTest
  MESSAGE = "Hello World"

  # Ruby's test_read.
  def test_fibers_exchange_a_message_over_a_socket_pair
    inside, outside = UNIXSocket.pair
    message = nil
    on_scheduler_thread do
      schedule do
        message = inside.read(20)
        inside.close
      end
      schedule do
        outside.write(MESSAGE)
        outside.close
      end
    end
    assert_equal MESSAGE, message
    assert_predicate inside, :closed?
    assert_predicate outside, :closed?
  ensure
    [inside, outside].each { |io| io&.close unless io&.closed? }
  end

  # Ruby's test_heavy_read.
  def test_sixteen_threads_each_with_a_loop_of_their_own
    messages = Thread::Queue.new
    16.times.map do
      Thread.new do
        inside, outside = UNIXSocket.pair
        on_scheduler_thread do
          schedule { messages << inside.read(20) }
          schedule do
            outside.write(MESSAGE)
            outside.close
          end
        end
      ensure
        inside&.close
        outside&.close unless outside&.closed?
      end
    end.each(&:join)
    assert_equal [MESSAGE] * 16, Array.new(messages.size) { messages.pop }
  end

  def test_a_megabyte_through_a_pipe_between_two_fibers
    reader, writer = IO.pipe
    payload = Random.new(42).bytes(1024 * 1024)
    received = nil
    on_scheduler_thread do
      schedule do
        received = reader.read
        reader.close
      end
      schedule do
        writer.write(payload) # far more than the pipe holds: both sides wait in turn
        writer.close
      end
    end
    assert_equal payload.bytesize, received.bytesize
    assert_equal Digest::SHA256.hexdigest(payload), Digest::SHA256.hexdigest(received)
  ensure
    reader&.close unless reader&.closed?
    writer&.close unless writer&.closed?
  end

  # Ruby's test_epipe_on_read.
  def test_writing_to_a_socket_whose_peer_closed_raises_epipe
    inside, outside = UNIXSocket.pair
    error = nil
    on_scheduler_thread do
      schedule do
        inside.close
        outside.write(MESSAGE)
      rescue SystemCallError => e
        error = e
      end
    end
    assert_kind_of Errno::EPIPE, error
  ensure
    inside&.close unless inside&.closed?
    outside&.close
  end

  # Ruby's test_tcp_accept.
  def test_a_fiber_accepts_and_writes_to_a_tcp_client
    server = TCPServer.new("127.0.0.1", 0)
    thread = Thread.new do
      on_scheduler_thread do
        schedule do
          client = server.accept
          client.wait_writable
          client.write("hello")
          client.close
        end
      end
    end
    receiver = TCPSocket.new("127.0.0.1", server.local_address.ip_port)
    assert_equal "hello", receiver.read
    thread.join
  ensure
    receiver&.close
    server&.close
  end

  # Ruby's test_tcp_connect.
  def test_a_fiber_connects_and_writes_to_a_tcp_server
    server = TCPServer.new("127.0.0.1", 0)
    thread = Thread.new do
      on_scheduler_thread do
        schedule do
          sender = TCPSocket.new("127.0.0.1", server.local_address.ip_port)
          sender.write("hello")
          sender.close
        end
      end
    end
    receiver = server.accept
    assert_equal "hello", receiver.read
    thread.join
  ensure
    receiver&.close
    server&.close
  end

  def test_an_echo_server_and_ten_clients_in_fibers_of_one_loop
    server = TCPServer.new("127.0.0.1", 0)
    port = server.local_address.ip_port
    replies = []
    on_scheduler_thread do
      schedule do
        10.times do
          connection = server.accept
          schedule do
            while (line = connection.gets)
              connection.write(line.upcase)
            end
          ensure
            connection.close
          end
        end
      end
      10.times do |index|
        schedule do
          socket = TCPSocket.new("127.0.0.1", port)
          socket.write("client #{index}\n")
          sleep 0.01
          socket.write("again #{index}\n")
          socket.close_write
          replies << socket.read
        ensure
          socket&.close
        end
      end
    end
    expected = 10.times.map { |index| "CLIENT #{index}\nAGAIN #{index}\n" }
    assert_equal expected.sort, replies.sort
  ensure
    server&.close
  end

  def test_wait_readable_with_a_timeout_returns_nil_when_nothing_arrives
    inside, outside = UNIXSocket.pair
    result = :unset
    waited = nil
    other_fiber_ran = false
    on_scheduler_thread do
      schedule { waited = elapsed { result = inside.wait_readable(0.05) } }
      schedule { other_fiber_ran = true }
    end
    assert_nil result
    assert_operator waited, :>=, 0.04
    assert_operator waited, :<, 1
    assert other_fiber_ran
  ensure
    inside&.close
    outside&.close
  end

  def test_wait_readable_returns_as_soon_as_data_arrives
    inside, outside = UNIXSocket.pair
    result = nil
    waited = nil
    on_scheduler_thread do
      schedule { waited = elapsed { result = inside.wait_readable(5) } }
      schedule do
        sleep 0.01
        outside.write("x")
      end
    end
    assert result, "wait_readable returned #{result.inspect}"
    assert_operator waited, :<, 1
  ensure
    inside&.close
    outside&.close
  end

  def test_wait_writable_waits_until_the_peer_drains_the_socket
    inside, outside = UNIXSocket.pair
    events = []
    on_scheduler_thread do
      schedule do
        filled = 0
        loop do
          written = outside.write_nonblock("x" * 65_536, exception: false)
          break if written == :wait_writable

          filled += written
        end
        events << :full
        outside.wait_writable(5)
        events << :writable_again
      end
      schedule do
        sleep 0.01
        events << :draining
        loop { break if inside.read_nonblock(1_000_000, exception: false) == :wait_readable }
      end
    end
    assert_equal %i[full draining writable_again], events
  ensure
    inside&.close
    outside&.close
  end

  def test_read_nonblock_and_write_nonblock_do_not_wait
    inside, outside = UNIXSocket.pair
    results = []
    on_scheduler_thread do
      schedule do
        results << inside.read_nonblock(20, exception: false)
        results << outside.write_nonblock(MESSAGE, exception: false)
        results << inside.read_nonblock(20, exception: false)
      end
    end
    assert_equal [:wait_readable, MESSAGE.bytesize, MESSAGE], results
  ensure
    inside&.close
    outside&.close
  end

  # Ruby's test_read_write_blocking: descriptors in blocking mode still wait
  # through the scheduler; reading one byte more than is sent forces a wait.
  def test_sockets_in_blocking_mode_wait_through_the_scheduler
    inside, outside = UNIXSocket.pair
    inside.nonblock = false
    outside.nonblock = false
    events = []
    on_scheduler_thread do
      schedule do
        events << [:read, inside.read(MESSAGE.bytesize + 1)]
      end
      schedule do
        events << :writing
        outside.write(MESSAGE)
        outside.close
      end
    end
    assert_equal [:writing, [:read, MESSAGE]], events
  ensure
    inside&.close
    outside&.close unless outside&.closed?
  end

  # Ruby's test_puts_empty.
  def test_puts_of_empty_lines
    inside, outside = UNIXSocket.pair
    inside.nonblock = false
    outside.nonblock = false
    on_scheduler_thread do
      schedule do
        outside.puts ""
        outside.puts nil
        outside.close
      end
    end
    assert_equal "\n\n", inside.read
  ensure
    inside&.close
    outside&.close unless outside&.closed?
  end

  # Ruby's test_io_select, with IOs that are already ready.
  def test_io_select_on_ready_ios_returns_them
    inside, outside = UNIXSocket.pair
    result = nil
    on_scheduler_thread do
      schedule do
        outside.write(MESSAGE)
        result = IO.select([inside], [outside])
      end
    end
    assert_equal [[inside], [outside], []], result
  ensure
    inside&.close
    outside&.close
  end

  # IO.select passes the scheduler only the arguments it was given.
  def test_io_select_with_only_ios_to_read
    inside, outside = UNIXSocket.pair
    result = nil
    on_scheduler_thread do
      schedule do
        outside.write(MESSAGE)
        result = IO.select([inside])
      end
    end
    assert_equal [[inside], [], []], result
  ensure
    inside&.close
    outside&.close
  end

  def test_io_select_waits_without_holding_up_other_fibers
    requires_ruby "3.2", "Ruby 3.1 has no io_select scheduler hook: IO.select blocks the whole thread " \
                         "(with Ruby's reference scheduler too)"
    inside, outside = UNIXSocket.pair
    events = []
    on_scheduler_thread do
      schedule do
        ready = IO.select([inside], nil, nil, 5)
        events << [:selected, ready&.first]
      end
      schedule do
        events << :writing
        outside.write("x")
      end
    end
    assert_equal [:writing, [:selected, [inside]]], events
  ensure
    inside&.close
    outside&.close
  end

  def test_io_select_with_a_timeout_returns_nil_when_nothing_is_ready
    inside, outside = UNIXSocket.pair
    result = :unset
    waited = nil
    on_scheduler_thread { schedule { waited = elapsed { result = IO.select([inside], nil, nil, 0.05) } } }
    assert_nil result
    assert_operator waited, :>=, 0.04
    assert_operator waited, :<, 1
  ensure
    inside&.close
    outside&.close
  end

  def test_io_timeout_raises_io_timeout_error
    requires_ruby "3.2", "IO#timeout is new in Ruby 3.2"
    inside, outside = UNIXSocket.pair
    inside.timeout = 0.05
    error = nil
    on_scheduler_thread do
      schedule do
        inside.read(1)
      rescue IO::TimeoutError => e
        error = e
      end
    end
    assert_kind_of IO::TimeoutError, error
  ensure
    inside&.close
    outside&.close
  end
end
