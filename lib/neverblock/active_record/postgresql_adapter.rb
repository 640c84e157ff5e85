# frozen_string_literal: true

require "active_record/connection_adapters/postgresql_adapter"

require_relative "../active_record"
require_relative "../postgres"

module NeverBlock
  module ActiveRecord
    # `adapter: neverblock_postgresql`: ActiveRecord's PostgreSQL adapter on
    # {NeverBlock::Postgres::Connection}s, whose queries are cancelled on the
    # server when a timeout interrupts them. pg already waits through the
    # fiber scheduler, so queries suspend only the calling fiber. It still
    # reports itself as "PostgreSQL", so code and gems that check
    # `adapter_name` see no difference.
    class PostgreSQLAdapter < ::ActiveRecord::ConnectionAdapters::PostgreSQLAdapter
      class << self
        # Opens the raw connection (ActiveRecord calls this with the
        # database.yml parameters translated for libpq).
        # @param conn_params [Hash]
        # @return [NeverBlock::Postgres::Connection]
        # @raise [::ActiveRecord::NoDatabaseError, ::ActiveRecord::ConnectionNotEstablished]
        def new_client(conn_params)
          NeverBlock::Postgres::Connection.new(**conn_params)
        rescue ::PG::Error => e
          dbname = conn_params && conn_params[:dbname]
          if dbname && e.message.include?(%("#{dbname}" does not exist))
            raise ::ActiveRecord::NoDatabaseError.db_error(dbname)
          end

          raise ::ActiveRecord::ConnectionNotEstablished, e.message
        end

        # The types migrations write (`t.datetime` as `datetime_type` says).
        # The stock class caches this table in an instance variable of its
        # own, which a subclass would fill once and keep apart: the stock
        # class's table is used instead, so that
        # `ActiveRecord::ConnectionAdapters::PostgreSQLAdapter.datetime_type`
        # (Rails' documented setting) and anything that rebuilds the table
        # mean the same here. Only a `datetime_type` set on this class
        # itself gives it a table of its own.
        # @return [Hash{Symbol => Hash}]
        def native_database_types
          return superclass.native_database_types if datetime_type == superclass.datetime_type

          super
        end
      end
    end
  end
end

NeverBlock::ActiveRecord.share_types(:postgresql, :neverblock_postgresql)
