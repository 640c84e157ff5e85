# frozen_string_literal: true

require "active_record/connection_adapters/mysql2_adapter"

require_relative "../active_record"
require_relative "mysql_client"
require_relative "../mysql/mysql2_connection"

module NeverBlock
  module ActiveRecord
    # `adapter: neverblock_mysql2`: ActiveRecord's Mysql2 adapter, whose
    # client connects on NeverBlock's thread pool (mysql2's connect blocks
    # the thread) and whose interrupted queries are killed on the server
    # ({MySQLClient}). mysql2 waits for a query's reply through the fiber
    # scheduler, but reads the reply with the thread blocked: a large result
    # holds the loop while it arrives (see NeverBlock::MySQL).
    class Mysql2Adapter < ::ActiveRecord::ConnectionAdapters::Mysql2Adapter
      class << self
        # @param config [Hash]
        # @return [Mysql2::Client]
        def new_client(config)
          MySQLClient.open(NeverBlock::MySQL::Mysql2Connection, config) { super }
        end
      end
    end
  end
end

NeverBlock::ActiveRecord.share_types(:mysql2, :neverblock_mysql2)
