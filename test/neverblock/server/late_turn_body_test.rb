# frozen_string_literal: true

require_relative "server_helper"

# A body whose bytes came in time is not refused because the loop was held
# when they did: the selector resumes the fibers whose sockets are ready,
# then the loop fires the timers that fell due. Bytes that arrived while a
# fiber resumed there held the loop met a timer that had fallen due too,
# and the wait for them ended as if none had come: 408 for a body sent
# within its window. A wait that runs out now reads once more.
class ServerLateTurnBodyTest < PlainTest
  include ServerHelper

  HOLD = 1.5 # seconds the app holds the loop, past the body's window

  def test_bytes_that_came_while_the_loop_was_held_are_read_not_refused
    held = Queue.new
    app = lambda do |env|
      if env["PATH_INFO"] == "/hold"
        held << true
        deadline = NeverBlock::Clock.now + HOLD
        nil while NeverBlock::Clock.now < deadline # CPU: nothing else on the loop runs
        [200, { "content-length" => "4" }, ["held"]]
      else
        body = env["rack.input"].read
        [200, { "content-length" => body.bytesize.to_s }, [body]]
      end
    end
    start_server(app, body_timeout: 1, min_body_rate: 0)
    upload = connect
    holder = connect
    upload.write("POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nx")
    sleep 0.5 # the head and a byte are read; the body's window ends 1 s after its last byte
    holder.write(get("/hold"))
    Timeout.timeout(30) { held.pop } # the loop is held from here
    upload.write("y") # within the window, while the loop is held
    status, _, body = read_response(upload, timeout: 30)
    assert_equal [200, "xy"], [status, body]
    assert_equal 200, read_response(holder, timeout: 30).first
  ensure
    upload&.close
    holder&.close
  end
end
