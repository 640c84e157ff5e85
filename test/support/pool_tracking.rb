# frozen_string_literal: true

require "securerandom"

# What NeverBlockTest::PostgresHelpers and ::MySQLHelpers share: pools tracked
# and closed in teardown, and tables dropped in teardown. The including module
# defines `with_admin` (a session of its own) and `drop_table(admin, table)`.
#
# (Loaded by test_helper after the NeverBlockTest class is defined.)
module NeverBlockTest::PoolTracking
  def setup
    @clients = []
    @tables = []
  end

  def teardown
    with_admin { |admin| @tables.each { |table| drop_table(admin, table) } } if @tables.any?
    @clients.each(&:close)
  end

  private

  # Closes `db` in teardown. @return `db`
  def track(db)
    db.tap { @clients << db }
  end

  def unique_name(prefix)
    "nb_#{prefix}_#{SecureRandom.hex(6)}"
  end
end
