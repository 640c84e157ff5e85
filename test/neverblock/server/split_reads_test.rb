# frozen_string_literal: true

require_relative "server_helper"
require_relative "smuggling_corpus"
require_relative "../../support/smuggling_check"
require_relative "../../support/socket_queues"

# One verdict per request, however its bytes arrive: a request sent in two
# writes, the server having read the first before the second is sent, is
# answered as when it is sent in one. Each case below (of SmugglingCorpus:
# the request-line, empty-line, transfer-coding and OWS cases) is sent
# split at every byte, on as many connections at once, to a real server,
# with and without the C head parser. (The parser's side of this, for
# every corpus case: framing_test.rb.)
class ServerSplitReadsTest < PlainTest
  include ServerHelper

  CASES = %w[
    double-space lf-request-line tab-in-target ff-in-target empty-lines-few empty-lines-many
    empty-line-bare-cr control-empty-lines gzip-chunked-te-te cl-trailing-tab
  ].freeze

  # Answers with what it was asked: method, target and body bytes.
  ECHO = lambda do |env|
    body = "#{env['REQUEST_METHOD']} #{SmugglingCheck.target(env)} #{env['rack.input'].read.bytesize}"
    [200, { "content-type" => "text/plain", "content-length" => body.bytesize.to_s }, [body]]
  end

  def setup
    super
    # Every connection of a case may hold a request slot at once (a head
    # whose body is still to come), whatever the load.
    start_server(ECHO, idle_timeout: 30, adaptive_limit: false)
  end

  def test_every_split_of_a_case_gets_the_answer_the_whole_case_gets
    capture_log do # the server's refusal lines
      CASES.each do |name|
        bytes = SmugglingCorpus::CASES.find { |kase| kase.name == name }&.bytes or flunk "no corpus case #{name}"
        whole = answers([[bytes]]).first
        splits = (1...bytes.bytesize).to_a
        answers(splits.map { |at| [bytes.byteslice(0, at), bytes.byteslice(at, bytes.bytesize - at)] })
          .zip(splits).each do |answer, at|
          assert_equal whole, answer, "#{name} split after byte #{at}: ...#{bytes.byteslice([0, at - 40].max, [at, 40].min).inspect} | ..."
        end
      end
    end
  end

  private

  # Sends each list of pieces on a connection of its own, all at once: a
  # piece once the server has read every connection's piece before it;
  # then half-closes them.
  # @return [Array<String>] what each connection read until the server
  #   closed it, without the headers that name a time or the close
  def answers(readings)
    sockets = readings.map { connect }
    readings.map(&:size).max.times do |index|
      SocketQueues.wait_until_read(@port, sockets) if index.positive?
      sockets.zip(readings) { |socket, pieces| send_piece(socket, pieces[index]) }
    end
    sockets.each do |socket|
      socket.close_write
    rescue SystemCallError
      nil # reset by a server that refused and closed
    end
    sockets.map { |socket| read_all(socket).gsub(/^(?:date|connection): [^\r]*\r\n/i, "") }
  ensure
    sockets&.each(&:close)
  end

  def send_piece(socket, piece)
    socket.write(piece) if piece
  rescue Errno::EPIPE, Errno::ECONNRESET
    nil # the server refused what came before and closed: its answer is read below
  end
end

# The same, every head through llhttp (as without the C extension).
class ServerSplitReadsLlhttpHeadsTest < ServerSplitReadsTest
  include LlhttpHeads
end
