# frozen_string_literal: true

require "io/wait"
require "socket"
require_relative "../neverblock/server/smuggling_corpus"

# Sends SmugglingCorpus's cases (test/neverblock/server/smuggling_corpus.rb)
# and judges what a server served of each, sent directly or through a
# FrontProxy: test/neverblock/server/differential_test.rb asserts on the
# verdicts, bench/smuggling.rb tabulates them.
#
# A server fails a case when it serves a request nobody sent: directly, any
# `/smuggled-` request (it was hidden in the case's bytes); behind a proxy,
# any request the proxy did not forward (same method and target, and body
# length where the proxy logs it). Refusing (400) what a proxy forwarded is
# no failure. A control case fails unless served whole.
module SmugglingCheck
  # A request a server served: method, target (path and query), body bytes.
  Served = Struct.new(:method, :target, :body_bytes)

  # What a server did with one case: label, e.g. "400", "proxy 400", "ok",
  # "served /smuggled"; failure, why it is one (nil when not); smuggled,
  # how many `/smuggled-` requests it served that nobody sent.
  Verdict = Struct.new(:label, :failure, :smuggled)

  # The verdicts' key for requests served that name no case.
  NO_CASE = "(no case)"

  module_function

  # Sends `bytes` on a new connection to 127.0.0.1:`port` and reads until
  # the other side closes it.
  # @param half_close [Boolean] shut down our side once sent: a server then
  #   closes once it has answered (a FrontProxy closes idle connections itself)
  # @param timeout [Numeric] seconds to wait for each read
  # @return [String, nil] every byte read; nil when the connection was still
  #   open after `timeout`
  def exchange(port, bytes, half_close:, timeout: 10)
    response = +"".b
    socket = TCPSocket.new("127.0.0.1", port)
    begin
      socket.write(bytes)
      socket.close_write if half_close
    rescue Errno::EPIPE, Errno::ECONNRESET
      nil # closed while we sent (a refusal of a long head): read its answer
    end
    loop do
      return nil unless socket.wait_readable(timeout)

      response << socket.readpartial(65_536)
    end
  rescue EOFError, Errno::ECONNRESET
    response
  ensure
    socket&.close
  end

  # @return [String] a Rack env's request target, as a proxy logs it: path and query
  def target(env)
    query = env["QUERY_STRING"].to_s
    query.empty? ? env["PATH_INFO"] : "#{env['PATH_INFO']}?#{query}"
  end

  # Judges every case.
  # @param responses [Hash{String => String, nil}] by case name, what {.exchange} read
  # @param served [Array<Served>] every request the server served meanwhile
  # @param forwarded [Array<FrontProxy::Forwarded>, nil] every request the
  #   proxy sent meanwhile; nil when the cases were sent directly
  # @return [Hash{String => Verdict}] by case name, in the corpus's order,
  #   and under {NO_CASE} the requests served that no case sent, if any
  def judge_all(responses, served:, forwarded: nil)
    served_by = served.group_by { |request| SmugglingCorpus.case_named_by(request.target) }
    forwarded_by = forwarded&.group_by { |request| SmugglingCorpus.case_named_by(request.target) }
    verdicts = SmugglingCorpus::CASES.select { |kase| responses.key?(kase.name) }.to_h do |kase|
      [kase.name, judge(kase, responses[kase.name], served_by.fetch(kase.name, []), forwarded_by&.fetch(kase.name, []))]
    end
    if (strays = served_by[nil])
      verdicts[NO_CASE] = Verdict.new("served unsent", "served #{describe(strays)}, which no case sent",
                                      strays.count { |request| SmugglingCorpus.smuggled?(request.target) })
    end
    verdicts
  end

  # @param kase [SmugglingCorpus::Case]
  # @param response [String, nil] what the client read ({.exchange})
  # @param served [Array<Served>] what the server served of the case
  # @param forwarded [Array<FrontProxy::Forwarded>, nil] what the proxy sent of it; nil: sent directly
  # @return [Verdict]
  def judge(kase, response, served, forwarded = nil)
    unsent = forwarded ? unsent(served, forwarded) : served.select { |request| SmugglingCorpus.smuggled?(request.target) }
    smuggled = unsent.count { |request| SmugglingCorpus.smuggled?(request.target) }
    unless unsent.empty?
      sent = forwarded ? "which the proxy did not send (it sent #{forwarded.empty? ? 'nothing' : describe(forwarded)})" : "hidden in the case's bytes"
      return Verdict.new(smuggled.positive? ? "served /smuggled" : "served unsent", "served #{describe(unsent)}, #{sent}", smuggled)
    end
    if kase.control? && served.map { |request| [request.method, request.target, request.body_bytes] } != kase.expected
      return Verdict.new("incomplete", "served #{served.empty? ? 'nothing' : describe(served)} of a valid case " \
                                       "(answered #{statuses(response).join(', ').then { |s| s.empty? ? 'nothing' : s }})", 0)
    end
    return Verdict.new("no close", "the connection stayed open, nothing more to read (the client's read timed out)", 0) if response.nil?

    Verdict.new(label(served, forwarded, response), nil, 0)
  end

  # The served requests that `forwarded` does not account for, each
  # forwarded request accounting for one.
  def unsent(served, forwarded)
    left = forwarded.dup
    served.reject do |request|
      index = left.index do |sent|
        sent.method == request.method && sent.target == request.target && (sent.body_bytes.nil? || sent.body_bytes == request.body_bytes)
      end
      left.delete_at(index) if index
    end
  end

  # A case handled without failure: "ok" when the server served some of
  # it, else the status the client got ("proxy 400" when the proxy
  # answered itself).
  def label(served, forwarded, response)
    status = statuses(response).first || "closed"
    if served.empty?
      forwarded&.empty? ? "proxy #{status}" : status
    elsif forwarded&.any? { |request| SmugglingCorpus.smuggled?(request.target) }
      "ok, proxy sent /smuggled"
    else
      "ok"
    end
  end

  # @return [Array<String>] the status of every response in `response`
  def statuses(response)
    response.to_s.scan(%r{HTTP/1\.[01] (\d{3}) }).flatten
  end

  # @return [String] e.g. "GET /smuggled-cl-te (0 bytes), POST /cl-te (133 bytes)"
  def describe(requests)
    requests.map do |request|
      target = request.target.length > 60 ? "#{request.target[0, 60]}..." : request.target
      "#{request.method} #{target.dump[1...-1]}#{" (#{request.body_bytes} bytes)" if request.body_bytes}"
    end.join(", ")
  end
end
