# frozen_string_literal: true

require "test_helper"
require "active_record"
require "active_record/database_configurations"
require "neverblock/server"
require "neverblock/rails_integration"
require "socket"

# An app whose ActiveRecord database is SQLite gets at most a few requests
# in the app at once under NeverBlock's server (RailsIntegration::SqliteGate):
# SQLite takes one writer at a time and its busy timeout runs for every
# request inside it, so twenty writers at once failed where Puma's three
# threads queued them outside.
class ActiveRecordSqliteGateTest < PlainTest
  Gate = NeverBlock::RailsIntegration::SqliteGate

  def teardown
    Gate.reset
    @server&.stop
    @server_thread&.join(20)
    super
  end

  def config(adapter, name = "primary")
    ActiveRecord::DatabaseConfigurations::HashConfig.new("production", name, { "adapter" => adapter, "database" => "db/x" })
  end

  def configure(configs, value = nil)
    previous = ENV.fetch(Gate::SWITCH, nil)
    value.nil? ? ENV.delete(Gate::SWITCH) : ENV[Gate::SWITCH] = value
    log = StringIO.new
    logger = NeverBlock.logger
    NeverBlock.logger = Logger.new(log)
    gate = Gate.configure(configs, "production")
    [gate, log.string]
  ensure
    NeverBlock.logger = logger
    previous.nil? ? ENV.delete(Gate::SWITCH) : ENV[Gate::SWITCH] = previous
  end

  def test_a_primary_sqlite_database_opens_the_gate_at_five_and_says_so_in_one_line
    gate, log = configure([config("sqlite3"), config("sqlite3", "cache")])
    assert_equal Gate::DEFAULT, gate.limit
    assert_same gate, Gate.semaphore
    assert_equal 1, log.lines.size, log
    assert_match(/"primary" \(production\) is SQLite.*at most 5 requests run in the app at once.*NEVERBLOCK_SQLITE_REQUESTS/, log)
  end

  def test_the_variable_sets_the_number_or_turns_it_off
    assert_equal 3, configure([config("sqlite3")], "3").first.limit
    gate, log = configure([config("sqlite3")], "off")
    assert_nil gate
    assert_nil Gate.semaphore
    assert_empty log
  end

  def test_a_bad_number_is_a_clear_error
    ["0", "-2", "many", "2.5"].each do |value|
      error = assert_raises(ArgumentError) { configure([config("sqlite3")], value) }
      assert_includes error.message, "NEVERBLOCK_SQLITE_REQUESTS must be a positive number of requests or off; got #{value.inspect}"
    end
  end

  def test_other_databases_leave_every_request_through
    assert_nil configure([config("postgresql"), config("sqlite3", "cache")]).first
    assert_nil configure([]).first
  end

  # Twenty requests at once through the gate, under NeverBlock's server,
  # which reads ActiveRecord's configurations as it starts: five at most
  # are in the app together, and every one is answered. On PostgreSQL all
  # twenty are in at once (as all twenty were on SQLite before the gate).
  def test_under_the_server_on_sqlite_five_requests_are_in_the_app_at_once_and_all_are_served
    with_database("sqlite3") { assert_equal [5, ["200"] * 20], serve_twenty }
  end

  def test_under_the_server_on_postgresql_every_request_is_in_the_app_at_once
    with_database("postgresql") { assert_equal [20, ["200"] * 20], serve_twenty }
  end

  # The Railtie puts the gate in a Rails app's middleware.
  def test_the_railtie_adds_the_gate_to_a_rails_app
    out, err, status = run_ruby(<<~RUBY, timeout: 60)
      require "tmpdir"
      require "rails"
      require "active_record/railtie"
      require "neverblock"
      class App < Rails::Application
        config.eager_load = false
        config.logger = Logger.new(nil)
        config.secret_key_base = "x" * 64
        config.root = Dir.tmpdir
      end
      App.initialize!
      puts App.middleware.include?(NeverBlock::RailsIntegration::SqliteGate)
    RUBY
    assert status.success?, err
    assert_equal "true\n", out
  end

  private

  # ActiveRecord's configurations for the environment the server reads,
  # with a primary database on `adapter`, for the block.
  def with_database(adapter)
    previous = ActiveRecord::Base.configurations
    env = ActiveRecord::ConnectionHandling::DEFAULT_ENV.call.to_s
    ActiveRecord::Base.configurations = { env => { "adapter" => adapter, "database" => "db/x" } }
    yield
  ensure
    ActiveRecord::Base.configurations = previous
  end

  # Returns the most requests that were in the app at once, and the statuses.
  def serve_twenty
    inside = 0
    most = 0
    app = lambda do |_env|
      inside += 1
      most = [most, inside].max
      sleep 0.1
      inside -= 1
      [200, { "content-type" => "text/plain", "content-length" => "2" }, ["ok"]]
    end
    @server = NeverBlock::Server.new(Gate.new(app), bind: ["tcp://127.0.0.1:0"], workers: 0, adaptive_limit: false)
    port = Integer(@server.bound_addresses.first[/\d+\z/])
    @server_thread = Thread.new { @server.run }
    statuses = Array.new(20) do
      Thread.new do
        TCPSocket.open("127.0.0.1", port) do |socket|
          socket.write("GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
          socket.read[%r{\AHTTP/1\.1 (\d+)}, 1]
        end
      end
    end.map(&:value)
    [most, statuses]
  end
end
