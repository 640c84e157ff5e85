# frozen_string_literal: true

require_relative "compat_helper"

# Message brokers, each call a request answered 0.5 s later.
class CompatMessagingTest < CompatTest
  include NeverBlockTest::Databases

  # bunny against RabbitMQ: each task connects, publishes a request and waits
  # for the reply, which a responder on a thread of its own (outside the
  # loop) sends 0.5 s after the request arrived.
  def test_bunny_request_and_reply
    require "bunny"
    queue = "neverblock.compat.#{Process.pid}.#{name}"
    responder = start_responder(queue)
    replies = assert_concurrent_calls("bunny (RabbitMQ): request, reply 0.5 s later", gem: "bunny") do |index|
      request(amqp_url, queue, "request #{index}")
    end
    assert_equal CALLS.times.map { |index| "reply to request #{index}" }, replies
  ensure
    responder&.close
  end

  # bunny's handshake waits for the broker with IO.select (the io_select
  # hook exists from Ruby 3.2): through a link that holds each answer
  # 0.125 s, the four round trips of a connect take 0.5 s.
  def test_bunny_connect_over_a_slow_link
    require "bunny"
    link = slow_proxy(*URI(amqp_url).then { |url| [url.host, url.port] }, delay: DELAY / 4)
    url = "amqp://guest:guest@#{link}"
    opened = assert_concurrent_calls("bunny (RabbitMQ): connect over a slow link", gem: "bunny",
                                     fix: (:io_select unless io_select_hook?)) do
      connection = Bunny.new(url, logger: Logger.new(nil)).tap(&:start)
      connection.open?
    ensure
      connection&.close
    end
    assert_equal [true] * CALLS, opened
  end

  private

  # One RPC over AMQP: a reply queue of its own, the request with reply_to,
  # then the reply (delivered on bunny's consumer thread, handed over
  # through a Thread::Queue, which waits through the fiber scheduler).
  def request(url, queue, body)
    connection = Bunny.new(url, logger: Logger.new(nil)).tap(&:start)
    channel = connection.create_channel
    replies = Thread::Queue.new
    reply_queue = channel.queue("", exclusive: true)
    reply_queue.subscribe { |_, _, reply| replies << reply }
    channel.default_exchange.publish(body, routing_key: queue, reply_to: reply_queue.name)
    replies.pop
  ensure
    connection&.close
  end

  # A responder with a pool of CALLS consumer threads, so that the replies
  # are sent at once; publishing is serialised (a channel is not for
  # concurrent use), the waits are not.
  def start_responder(queue)
    connection = Bunny.new(amqp_url, logger: Logger.new(nil)).tap(&:start)
    channel = connection.create_channel(nil, CALLS)
    replying = Thread::Mutex.new
    channel.queue(queue, auto_delete: true).subscribe do |_, properties, body|
      sleep DELAY
      replying.synchronize { channel.default_exchange.publish("reply to #{body}", routing_key: properties.reply_to) }
    end
    connection
  end

  def io_select_hook?
    Gem::Version.new(RUBY_VERSION) >= Gem::Version.new("3.2")
  end
end
