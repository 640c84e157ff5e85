# frozen_string_literal: true

require_relative "server_helper"

# A streamed response (an `each` body, a `call(stream)` body, written in the
# request's fiber or by a task it spawned) ends as a request does: a client
# that hangs up has it cancelled at its current wait, between chunks too,
# with what it spawned; it is logged once as 499 and counted as hung up.
# Its gaps between chunks are a minute long: a body that ran on to its next
# write would be seen to.
class ServerStreamedResponseTest < PlainTest
  include ServerHelper

  GAP = 60 # seconds between two chunks

  def setup
    @logger = NeverBlock.logger
    NeverBlock.logger = Logger.new(@log = StringIO.new)
    @events = Queue.new
  end

  def teardown
    super
  ensure
    NeverBlock.logger = @logger
  end

  def pop(timeout: 30)
    Timeout.timeout(timeout) { @events.pop }
  end

  # A task standing for a query a chunk waits on: it reports its cancel.
  def self.query(events, seconds = GAP)
    NeverBlock.spawn do
      sleep seconds
    rescue NeverBlock::Cancelled
      events << :query_cancelled
      raise
    end
  end

  # Writes "first\n", then waits GAP seconds on a query before the next chunk.
  def each_body
    events = @events
    body = Object.new
    body.define_singleton_method(:each) do |&write|
      write.call("first\n")
      ServerStreamedResponseTest.query(events).wait
      write.call("second\n")
    ensure
      events << :body_unwound
    end
    body
  end

  # The same as a Rack 3 streaming body, writing in its `call`.
  def call_body
    events = @events
    lambda do |stream|
      stream.write("first\n")
      ServerStreamedResponseTest.query(events).wait
      stream.write("second\n")
    ensure
      events << :body_unwound
      stream.close
    end
  end

  # A streaming body whose `call` returns at once, leaving a task it spawned to write.
  def task_body
    events = @events
    lambda do |stream|
      NeverBlock.spawn do
        stream.write("first\n")
        ServerStreamedResponseTest.query(events).wait
        stream.write("second\n")
      ensure
        events << :body_unwound
        stream.close
      end
    end
  end

  def serve(body, **options)
    start_server(->(_env) { [200, { "content-type" => "text/plain" }, body] },
                 access_log: @access = StringIO.new, **options)
  end

  # Sends a request for `path`, reads until `text` came, and hangs up.
  def hang_up_after(text, path = "/stream")
    socket = connect
    socket.write(get(path))
    seen = +""
    Timeout.timeout(10) { seen << socket.readpartial(4096) until seen.include?(text) }
    socket.close
  end

  def assert_cancelled_as_a_hang_up(path = "/stream")
    assert_equal %i[body_unwound query_cancelled], [pop, pop].sort
    eventually { @access.string.include?("\"GET #{path} HTTP/1.1\" 499") }
    assert_equal 1, @server.stats[:requests_hung_up]
    lines = @log.string.lines.grep(/hung up/)
    assert_equal 1, lines.size, @log.string
    assert_match(%r{GET #{path}: the client hung up during its streamed response; the request was cancelled}, lines.first)
    refute_match(/unhandled|Error/, @log.string, "one line, no failure or backtrace")
  end

  def test_an_each_body_waiting_between_chunks_is_cancelled_when_its_client_hangs_up
    serve(each_body)
    hang_up_after("first\n")
    assert_cancelled_as_a_hang_up
  end

  # StartPace reads how many streamed responses are being written: a stream
  # counts from its body's start to its end, however it ends.
  def test_a_streamed_body_counts_as_a_stream_open_until_it_ends
    serve(each_body)
    assert_equal 0, @server.stats[:streams_open]
    socket = connect
    socket.write(get("/stream"))
    read_until(socket, "first\n")
    assert_equal 1, @server.stats[:streams_open], "a stream open between its chunks"
    socket.close
    assert_cancelled_as_a_hang_up
    assert_equal 0, @server.stats[:streams_open]
  ensure
    socket&.close unless socket&.closed?
  end

  def test_a_body_answered_whole_is_no_stream
    serve(["whole\n"])
    socket = connect
    socket.write(get("/"))
    assert_includes read_until(socket, "whole"), "whole"
    assert_equal 0, @server.stats[:streams_open]
  ensure
    socket&.close
  end

  def test_a_call_stream_body_waiting_between_chunks_is_cancelled_when_its_client_hangs_up
    serve(call_body)
    hang_up_after("first\n")
    assert_cancelled_as_a_hang_up
  end

  def test_a_task_writing_to_the_stream_is_cancelled_when_its_client_hangs_up
    serve(task_body)
    hang_up_after("first\n")
    assert_cancelled_as_a_hang_up
  end

  # Without the watch (cancel_on_hangup: false) a write to a client that
  # hung up still ends the stream at once, and the request is a hang-up.
  def writing_forever(events)
    lambda do |stream|
      NeverBlock.spawn do
        loop do
          sleep 0.01
          stream.write("tick\n")
        end
      ensure
        events << :body_unwound
      end
    end
  end

  def test_a_failed_write_ends_a_stream_written_by_a_task_and_counts_as_a_hang_up
    serve(writing_forever(@events), cancel_on_hangup: false)
    hang_up_after("tick", "/ticks")
    assert_equal :body_unwound, pop
    eventually { @access.string.include?('"GET /ticks HTTP/1.1" 499') }
    assert_equal 1, @server.stats[:requests_hung_up]
    eventually { @server.stats[:requests_in_flight].zero? }
    sleep 1.5 # Failures logs an unhandled task failure within a second; there must be none
    refute_match(/unhandled/, @log.string, "the writer's ClientGone is the hang-up, logged once")
    assert_equal 1, @log.string.lines.grep(/hung up/).size, @log.string
  end

  def test_a_failed_write_ends_an_each_body_and_counts_as_a_hang_up
    events = @events
    body = Object.new
    body.define_singleton_method(:each) do |&write|
      loop do
        sleep 0.01
        write.call("tick\n")
      end
    ensure
      events << :body_unwound
    end
    serve(body, cancel_on_hangup: false)
    hang_up_after("tick", "/ticks")
    assert_equal :body_unwound, pop
    eventually { @access.string.include?('"GET /ticks HTTP/1.1" 499') }
    assert_equal 1, @server.stats[:requests_hung_up]
  end

  def test_a_client_that_stays_gets_every_chunk_across_several_looks_of_the_watch
    body = Object.new
    body.define_singleton_method(:each) do |&write|
      3.times do |index|
        sleep 0.7 # past a look of the watch each time
        write.call("chunk #{index}\n")
      end
    end
    serve(body)
    socket = connect
    socket.write(get)
    status, _headers, received = read_response(socket)
    assert_equal [200, "chunk 0\nchunk 1\nchunk 2\n"], [status, received]
    assert_equal 0, @server.stats[:requests_hung_up]
  end

  def test_request_timeout_cuts_a_stream_written_by_a_task_and_cancels_the_task
    serve(task_body, request_timeout: 1)
    socket = connect
    socket.write(get)
    response = read_all(socket)
    assert_includes response, "first\n"
    refute_includes response, "0\r\n\r\n", "no last chunk: the client sees the response is incomplete"
    assert_equal %i[body_unwound query_cancelled], [pop, pop].sort
    assert_equal 1, @server.stats[:requests_timed_out]
    assert_equal 0, @server.stats[:requests_hung_up]
  end
end
