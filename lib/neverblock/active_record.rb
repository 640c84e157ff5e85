# frozen_string_literal: true

require "active_record"
require "active_support/isolated_execution_state"

require_relative "../neverblock"
require_relative "active_record/async_queries"
require_relative "active_record/sqlite_write_turns"
require_relative "active_record/task_leases"

module NeverBlock
  # ActiveRecord inside NeverBlock: adapters that are a one-word change in
  # database.yml, and fiber-level connection ownership.
  #
  #   # Gemfile: gem "neverblock", require: "neverblock/active_record"
  #   # config/database.yml
  #   production:
  #     adapter: neverblock_postgresql   # was: postgresql
  #     pool: 32                         # connections shared by the process's fibers
  #
  # Requiring this file:
  # - registers the adapters `neverblock_postgresql`, `neverblock_mysql2`
  #   and `neverblock_trilogy` (loaded only when a configuration names them);
  # - runs `load_async` and the other async queries in tasks of the calling
  #   request instead of ActiveRecord's threads ({AsyncQueries});
  # - has SQLite transactions of NeverBlock's fibers take turns instead of
  #   racing for SQLite's write lock ({SqliteWriteTurns});
  # - sets Active Support's isolation level to `:fiber`, so that every
  #   fiber (every NeverBlock task, every request of a fiber server) checks
  #   out its own connection and has its own transaction; with the default
  #   `:thread` level all fibers of a thread would share one connection;
  # - gives a task's leased connections back as the task ends ({TaskLeases}),
  #   as Rails' executor does for a request;
  # - in a Rails app, adds a Railtie that keeps `config.active_support.isolation_level`
  #   at `:fiber`.
  #
  # Each adapter is the stock one with two differences: its connections'
  # waits suspend only the calling fiber (the stock PostgreSQL and Trilogy
  # adapters already do; see README for MySQL2), and a query interrupted by
  # a timeout is cancelled on the server instead of running on. Pool size,
  # `checkout_timeout` (ActiveRecord::ConnectionTimeoutError when no
  # connection is free) and everything else work as documented by Rails.
  module ActiveRecord
    # database.yml adapter name => [adapter class, file that defines it].
    ADAPTERS = {
      "neverblock_postgresql" => ["NeverBlock::ActiveRecord::PostgreSQLAdapter", "neverblock/active_record/postgresql_adapter"],
      "neverblock_mysql2" => ["NeverBlock::ActiveRecord::Mysql2Adapter", "neverblock/active_record/mysql2_adapter"],
      "neverblock_trilogy" => ["NeverBlock::ActiveRecord::TrilogyAdapter", "neverblock/active_record/trilogy_adapter"]
    }.freeze

    class << self
      # Registers the adapters and sets the isolation level. Runs when this
      # file is required; calling it again is harmless.
      # @return [void]
      def install
        ADAPTERS.each do |name, (class_name, path)|
          ::ActiveRecord::ConnectionAdapters.register(name, class_name, path)
        end
        pool = ::ActiveRecord::ConnectionAdapters::ConnectionPool
        pool.prepend(AsyncQueries) if pool.method_defined?(:schedule_query) && !(pool < AsyncQueries)
        ::ActiveSupport.on_load(:active_record_sqlite3adapter) do
          prepend(SqliteWriteTurns) unless self < SqliteWriteTurns
        end
        fiber_isolation!
        TaskLeases.install
      end

      # ActiveRecord keys the types of `attribute :x, :jsonb` (and
      # `array: true`, `:binary` as bytea, MySQL's `:unsigned_integer`, ...)
      # by the adapter name in database.yml: the types the stock adapter
      # registers for `from` are registered for `to` too, so that a
      # neverblock adapter types attributes exactly as the stock one.
      # @param from [Symbol] e.g. `:postgresql`
      # @param to [Symbol] e.g. `:neverblock_postgresql`
      # @return [void]
      def share_types(from, to)
        registrations = ::ActiveRecord::Type.registry.send(:registrations)
        registrations.select { |registration| registration.instance_variable_get(:@adapter) == from }.each do |registration|
          copy = registration.dup
          copy.instance_variable_set(:@adapter, to)
          registrations << copy
        end
      end

      # Makes Active Support (and with it ActiveRecord's connection pool)
      # give each fiber its own state. Rails apps get this through the
      # Railtie; call it yourself only if something reset the level.
      # @return [void]
      def fiber_isolation!
        return if ActiveSupport::IsolatedExecutionState.isolation_level == :fiber

        ActiveSupport::IsolatedExecutionState.isolation_level = :fiber
      end
    end
  end
end

NeverBlock::ActiveRecord.install
require_relative "active_record/railtie" if defined?(Rails::Railtie)
