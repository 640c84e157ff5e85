# frozen_string_literal: true

module NeverBlock
  module Postgres
    # A `PG::Connection` whose queries are cancelled on the server when the
    # calling fiber or thread is interrupted mid-query ({NeverBlock.timeout},
    # `Timeout.timeout`, {Task#cancel}, Thread#raise): the cancel request is
    # sent, the interrupted query's results are read and dropped, and the
    # interrupt propagates. Without this the query keeps running on the
    # server, and the connection's next query first waits for it to finish.
    #
    # The connection stays in the transaction state it was in before the
    # interrupted query (an open transaction is now failed): rolling back is
    # its owner's business, e.g. {Client#with} or ActiveRecord's transaction
    # handling. But a query that opened a transaction where there was none
    # (a `BEGIN` the server ran while the caller was interrupted) is undone
    # with a ROLLBACK: the caller saw it fail, and a transaction it does not
    # know about would swallow the next owner's autocommit writes. If the server
    # does not answer the cancel within {Recovery::RECOVERY_TIMEOUT} seconds,
    # the connection is closed, so its owner sees `PG::ConnectionBad` next.
    #
    # {Postgres.pool} and the `neverblock_postgresql` ActiveRecord adapter
    # open connections of this class; it is a subclass, pg itself is not
    # changed.
    class Connection < PG::Connection
      # @return [ConnectionPool, nil] the pool that opened it, told of the
      #   queries {Recovery} cancels (nil: one opened by ActiveRecord).
      attr_accessor :pool

      # The methods that send a query and wait for its result.
      QUERY_METHODS = %i[
        exec async_exec sync_exec query exec_params async_exec_params sync_exec_params
        exec_prepared async_exec_prepared sync_exec_prepared prepare async_prepare sync_prepare
        get_last_result async_get_last_result
      ].select { |name| PG::Connection.method_defined?(name) }.freeze

      # An argument not given. Each wrapper passes on exactly the arguments
      # it got without collecting them in an Array (`*args` would allocate
      # one per query); pg's query methods take at most four.
      UNSET = Object.new.freeze
      private_constant :UNSET

      QUERY_METHODS.each do |name|
        class_eval(<<~RUBY, __FILE__, __LINE__ + 1)
          def #{name}(a = UNSET, b = UNSET, c = UNSET, d = UNSET, &block)
            before = transaction_status
            begin
              if UNSET.equal?(a) then super(&block)
              elsif UNSET.equal?(b) then super(a, &block)
              elsif UNSET.equal?(c) then super(a, b, &block)
              elsif UNSET.equal?(d) then super(a, b, c, &block)
              else super(a, b, c, d, &block)
              end
            rescue Exception => e # rubocop:disable Lint/RescueException -- re-raised
              Recovery.cancel_interrupted(self, before) unless e.is_a?(PG::Error)
              raise
            end
          end
        RUBY
      end

      private

      # pg's connect (and reset) waits for the server in Ruby, on this
      # object, before `new` returns it: an interrupt there (a timeout
      # around ActiveRecord's first query, a cancelled task) left the
      # half-open connection to the garbage collector, socket and all.
      # Closed here instead, and the interrupt goes on.
      def async_connect_or_reset(poll_method)
        super
      rescue Exception # rubocop:disable Lint/RescueException -- re-raised
        finish unless finished?
        raise
      end
    end
  end
end
