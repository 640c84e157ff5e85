# frozen_string_literal: true

require_relative "server_helper"
require "tmpdir"

# The adaptive limit on request slots (NeverBlock::Server::ConcurrencyLimit):
# it lowers the requests admitted at once when computing requests saturate
# the loop, and admits every request at once when they wait on IO.
class ServerAdaptiveLimitTest < Minitest::Test
  include ServerHelper

  # An app that counts the requests inside it at once (the most ever seen)
  # and spends `cpu` seconds computing after a `wait` seconds' sleep. `wait`
  # may instead be a condition (called with the app) each request waits for,
  # polling, at most WAIT_LIMIT seconds: what the test waits for, not a time
  # a loaded machine may take to get there.
  class Counting
    WAIT_LIMIT = 30

    attr_reader :peak, :inside

    def initialize(wait:, cpu:)
      @wait = wait
      @cpu = cpu
      @inside = 0
      @peak = 0
    end

    def call(_env)
      @inside += 1
      @peak = @inside if @inside > @peak
      wait # the scheduler's sleep: other requests run meanwhile
      spin(@cpu)
      [200, { "content-type" => "text/plain", "content-length" => "3" }, ["ok\n"]]
    ensure
      @inside -= 1
    end

    private

    def wait
      return sleep(@wait) unless @wait.respond_to?(:call)

      deadline = NeverBlock::Clock.now + WAIT_LIMIT
      sleep 0.01 until @wait.call(self) || NeverBlock::Clock.now > deadline
    end

    def spin(seconds)
      deadline = Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID) + seconds
      nil while Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID) < deadline
    end
  end

  # @return [Array<String>] the status codes, `clients` keep-alive clients
  #   each sending `each` requests.
  def load(clients:, each:)
    Array.new(clients) do
      Thread.new do
        Net::HTTP.start("127.0.0.1", @port, read_timeout: 120) do |http|
          Array.new(each) { http.get("/").code }
        end
      end
    end.flat_map(&:value)
  end

  # The same from a forked process: its client threads do not take the
  # server's GVL, so the server's loop, not the clients, is what saturates.
  def load_from_child(clients:, each:)
    reader, writer = IO.pipe
    pid = fork do
      reader.close
      writer.write(load(clients: clients, each: each).join(" "))
      writer.close
      exit!(0)
    end
    writer.close
    codes = reader.read.split
    Process.wait(pid)
    codes
  ensure
    reader&.close
  end

  def test_computing_requests_lower_the_limit_and_are_all_answered
    app = Counting.new(wait: 0.001, cpu: 0.004)
    server = start_server(app, adaptive_limit: { min: 2, initial: 32 })

    codes = load_from_child(clients: 48, each: 8)

    assert_equal ["200"] * 384, codes
    stats = server.stats
    assert_operator stats[:adaptive_limit][:decreases], :>=, 1, stats.inspect
    assert_operator stats[:adaptive_limit][:limit], :<, 32, stats.inspect
    assert_operator app.peak, :<=, 32, "never more requests inside the app than the initial limit"
  end

  def test_requests_waiting_on_io_are_all_admitted_at_once
    app = Counting.new(wait: 1.0, cpu: 0)
    server = start_server(app, adaptive_limit: { initial: 8 })
    started = NeverBlock::Clock.now

    codes = load(clients: 60, each: 1)

    elapsed = NeverBlock::Clock.now - started
    assert_equal ["200"] * 60, codes
    assert_operator app.peak, :>, 8, "the limit rose above its start"
    assert_operator server.stats[:adaptive_limit][:increases], :>=, 1
    assert_operator elapsed, :<, 30, "one-second requests served together, not one after another (60 s)"
  end

  # A worker at its limit stops accepting: new connections wait in the
  # kernel's accept queue, where another worker of the same socket would take
  # them (Puma's wait_for_less_busy_worker, without the guess). Here the
  # server is one of two workers (Server#serve_here, what each forked worker
  # runs; the only worker takes in its whole backlog). A fiber pool of 2
  # keeps the limit at 2. With both slots taken, the acceptor waits for a
  # turn among the requests waiting for one (Acceptor#wait_turn) and takes
  # nothing in meanwhile.
  def test_at_its_limit_it_leaves_new_connections_in_the_accept_queue
    released = false
    app = Counting.new(wait: ->(_) { released }, cpu: 0) # the next three stay queued while the first two wait
    server = @server = NeverBlock::Server.new(Rack::Lint.new(app), bind: ["tcp://127.0.0.1:0"], workers: 2,
                                              fiber_pool: 2, adaptive_limit: { min: 2, initial: 2 })
    @port = Integer(server.bound_addresses.first[/\d+\z/])
    @server_thread = Thread.new { server.send(:serve_here) }
    listener = server.instance_variable_get(:@listeners).first
    # Two fill the slots first: connections that were all in the backlog at
    # the first accept would be taken in up to the worker's share of it
    # (Acceptor#take_in_after_first), however full its slots.
    sockets = Array.new(2) { connect.tap { |socket| socket.write(get) } }
    deadline = NeverBlock::Clock.now + 30
    sleep 0.01 until app.peak == 2 || NeverBlock::Clock.now > deadline
    assert_equal 2, app.peak, "the first two requests are in the app"
    sockets += Array.new(3) { connect.tap { |socket| socket.write(get) } }
    queued = nil
    deadline = NeverBlock::Clock.now + 30
    sleep 0.01 until (queued = listener.pending_connections) >= 3 || NeverBlock::Clock.now > deadline
    assert_operator queued, :>=, 3
    assert_operator server.stats[:connections], :<=, 2, "accepted only as many as the limit admits"
    released = true
    assert_equal [200] * 5, sockets.map { |socket| read_response(socket, timeout: 30).first }
    assert_equal 2, app.peak
  end

  # What stops the acceptors (the test above, whose pool equals its limit):
  # Admission#full? is reached at the adaptive limit, however large the pool.
  def test_admission_is_full_at_the_adaptive_limit_not_only_at_the_pool
    adaptive = NeverBlock::Server::Admission.new(size: 100, adaptive_limit: { min: 2, initial: 2 })
    fixed = NeverBlock::Server::Admission.new(size: 100, adaptive_limit: false)
    2.times { [adaptive, fixed].each(&:acquire) }
    assert adaptive.full?, "two slots taken of an adaptive limit of 2"
    refute fixed.full?, "two of 100 without an adaptive limit"
  end

  def test_disabled_it_admits_up_to_fiber_pool
    # Each request waits until all 40 are in the app (at most WAIT_LIMIT):
    # however slowly a loaded machine connects the 40 clients, the peak is
    # 40 if the server admits them all at once, and less if it holds some
    # back (they then wait out the limit).
    app = Counting.new(wait: ->(counting) { counting.inside >= 40 }, cpu: 0)
    server = start_server(app, fiber_pool: 40, adaptive_limit: false)

    codes = load(clients: 40, each: 1)

    assert_equal ["200"] * 40, codes
    assert_equal 40, app.peak
    stats = server.stats
    assert_nil stats[:adaptive_limit]
    assert_equal 40, stats[:fiber_pool][:limit]
  end

  def test_the_status_endpoint_shows_the_limit
    server = start_server(status_path: "/_status")
    body = Net::HTTP.get(URI("http://127.0.0.1:#{@port}/_status"))
    limit = JSON.parse(body).fetch("adaptive_limit")

    assert_equal [32, 4, 1000], limit.values_at("limit", "min", "max")
    assert_equal 32, server.stats[:fiber_pool][:limit]
  end

  def test_a_config_file_sets_it
    require "neverblock/cli/config_file"
    Dir.mktmpdir do |dir|
      file = File.join(dir, "neverblock.rb")
      File.write(file, "adaptive_limit target_lag: 0.01, min: 8\n")
      assert_equal({ target_lag: 0.01, min: 8 }, NeverBlock::CLI::ConfigFile.load(file)[:adaptive_limit])
      File.write(file, "adaptive_limit false\n")
      assert_equal false, NeverBlock::CLI::ConfigFile.load(file)[:adaptive_limit]
    end
  end

  def test_an_invalid_option_is_refused
    assert_raises(ArgumentError) { NeverBlock::Server.new(HELLO, adaptive_limit: :yes) }
    assert_raises(ArgumentError) { NeverBlock::Server.new(HELLO, adaptive_limit: { target_lag: 0 }) }
    assert_raises(ArgumentError) { NeverBlock::Server.new(HELLO, adaptive_limit: { mni: 3 }) }
  end
end

# The limit's rule on its own: lag samples in, a limit out.
class ConcurrencyLimitTest < Minitest::Test
  Limit = NeverBlock::Server::ConcurrencyLimit

  def window(limit, lag, busy:, waiting:)
    Array.new(Limit::WINDOW) { limit.sample(lag, busy: busy, waiting: waiting) }.last
  end

  def test_a_saturated_loop_lowers_it_from_the_requests_in_flight
    limit = Limit.new(max: 1000, initial: 1000, min: 4, target_lag: 0.005)
    window(limit, 0.05, busy: 200, waiting: 0)

    assert_equal 175, limit.limit # 7/8 of the 200 in flight, not of 1000
    40.times { window(limit, 0.05, busy: limit.limit, waiting: 10) }
    assert_equal 4, limit.limit
  end

  def test_spare_time_with_requests_waiting_raises_it
    limit = Limit.new(max: 100, initial: 8)

    assert window(limit, 0.0001, busy: 8, waiting: 50)
    assert_equal 10, limit.limit
    30.times { window(limit, 0.0001, busy: limit.limit, waiting: 50) }
    assert_equal 100, limit.limit
  end

  def test_spare_time_with_nobody_waiting_leaves_it
    limit = Limit.new(max: 100, initial: 8)

    refute window(limit, 0.0001, busy: 3, waiting: 0)
    assert_equal 8, limit.limit
  end

  def test_one_slow_sample_in_a_window_is_not_saturation
    limit = Limit.new(max: 100, initial: 20)
    (Limit::WINDOW - 1).times { limit.sample(0.0001, busy: 20, waiting: 0) }
    limit.sample(0.5, busy: 20, waiting: 0)

    assert_equal 20, limit.limit
  end
end
