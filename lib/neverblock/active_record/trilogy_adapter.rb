# frozen_string_literal: true

require "active_record/connection_adapters/trilogy_adapter"

require_relative "../active_record"
require_relative "mysql_client"
require_relative "../mysql/trilogy_connection"

module NeverBlock
  module ActiveRecord
    # `adapter: neverblock_trilogy`: ActiveRecord's Trilogy adapter, whose
    # client connects off the loop and whose interrupted queries are killed
    # on the server ({MySQLClient}). Trilogy waits for replies through the
    # fiber scheduler, so queries suspend only the calling fiber.
    class TrilogyAdapter < ::ActiveRecord::ConnectionAdapters::TrilogyAdapter
      class << self
        # @param config [Hash]
        # @return [Trilogy]
        def new_client(config)
          MySQLClient.open(NeverBlock::MySQL::TrilogyConnection, config) { super }
        end
      end
    end
  end
end

NeverBlock::ActiveRecord.share_types(:trilogy, :neverblock_trilogy)
