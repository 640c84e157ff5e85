# frozen_string_literal: true

require "test_helper"

# The Railtie of neverblock/active_record, in a minimal Rails app booted in a
# child process (Rails applications are one per process).
class ActiveRecordRailtieTest < PlainTest
  APP = <<~RUBY
    %<requires>s
    class App < Rails::Application
      config.eager_load = false
      config.logger = Logger.new(nil)
      config.secret_key_base = "x" * 64
      config.root = Dir.tmpdir
      %<config>s
    end
    App.initialize!
    puts ActiveSupport::IsolatedExecutionState.isolation_level
    puts ActiveRecord::ConnectionAdapters.resolve("neverblock_postgresql").name
  RUBY

  def boot(requires:, config: "")
    code = format(APP, requires: requires, config: config)
    out, err, status = run_ruby("require 'tmpdir'\n#{code}", timeout: 60)
    assert status.success?, "the app failed to boot:\n#{err}"
    out.lines.map(&:chomp)
  end

  def test_a_rails_app_runs_with_fiber_isolation
    level, adapter = boot(requires: "require 'rails'\nrequire 'active_record/railtie'\nrequire 'neverblock/active_record'")
    assert_equal "fiber", level
    assert_equal "NeverBlock::ActiveRecord::PostgreSQLAdapter", adapter
  end

  def test_requiring_neverblock_before_rails_still_gives_fiber_isolation
    level, = boot(requires: "require 'neverblock/active_record'\nrequire 'rails'\nrequire 'active_record/railtie'")
    assert_equal "fiber", level
  end

  def test_an_app_that_configures_thread_isolation_explicitly_keeps_its_choice
    level, = boot(requires: "require 'rails'\nrequire 'active_record/railtie'\nrequire 'neverblock/active_record'",
                  config: "config.active_support.isolation_level = :thread")
    assert_equal "thread", level
  end
end
