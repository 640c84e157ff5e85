# frozen_string_literal: true

require "test_helper"
require "fileutils"
require "tmpdir"

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

  # `gem "neverblock"` with no `require:`: Bundler.require loads
  # "neverblock" after Rails, and that is enough for database.yml's
  # `adapter: neverblock_postgresql`.
  def test_the_gem_alone_gives_fiber_isolation_and_registers_the_adapters
    level, adapter = boot(requires: "require 'rails'\nrequire 'active_record/railtie'\nrequire 'neverblock'")
    assert_equal "fiber", level
    assert_equal "NeverBlock::ActiveRecord::PostgreSQLAdapter", adapter
  end

  def test_without_rails_the_adapters_register_when_active_record_loads
    out, err, status = run_ruby(<<~RUBY, timeout: 60)
      require "active_support"
      require "neverblock"
      require "active_record"
      ActiveRecord::Base # loads, running the on_load hooks
      puts ActiveRecord::ConnectionAdapters.resolve("neverblock_trilogy").name
    RUBY
    assert status.success?, err
    assert_equal "NeverBlock::ActiveRecord::TrilogyAdapter\n", out
  end

  # `neverblock serve` loads neverblock before the app's config.ru loads
  # Rails, so Bundler.require's `require "neverblock"` is a no-op there: the
  # app is loaded inside RailsIntegration.while_loading_app, which installs
  # the Railtie when the app's class is defined.
  def test_an_app_loaded_as_neverblock_serve_loads_it_gets_the_railtie
    Dir.mktmpdir("nb-railtie") do |dir|
      app = File.join(dir, "app.rb")
      File.write(app, format(APP, requires: "require 'rails'\nrequire 'active_record/railtie'", config: ""))
      out, err, status = run_ruby(<<~RUBY, timeout: 60)
        require "tmpdir"
        require "neverblock"
        require "neverblock/rails_integration"
        NeverBlock::RailsIntegration.while_loading_app { load #{app.inspect} }
        puts defined?(NeverBlock::Railtie).inspect
      RUBY
      assert status.success?, "the app failed to boot:\n#{err}"
      assert_equal ["fiber", "NeverBlock::ActiveRecord::PostgreSQLAdapter", '"constant"'], out.lines.map(&:chomp)
    end
  end

  # The same for ActiveRecord without Rails: the adapters register as
  # ActiveRecord::Base loads, though Active Support arrives with the app.
  def test_an_active_record_app_loaded_as_neverblock_serve_loads_it_finds_the_adapters
    out, err, status = run_ruby(<<~RUBY, timeout: 60)
      require "neverblock"
      require "neverblock/rails_integration"
      NeverBlock::RailsIntegration.while_loading_app do
        require "active_record"
        ActiveRecord::Base # loads, running the on_load hooks
        # A config.ru connects as it loads, before while_loading_app returns.
        puts ActiveRecord::ConnectionAdapters.resolve("neverblock_mysql2").name
      end
    RUBY
    assert status.success?, err
    assert_equal "NeverBlock::ActiveRecord::Mysql2Adapter\n", out
  end

  def test_requiring_neverblock_before_rails_still_gives_fiber_isolation
    level, = boot(requires: "require 'neverblock/active_record'\nrequire 'rails'\nrequire 'active_record/railtie'")
    assert_equal "fiber", level
  end

  # In Rails a URL's scheme decides the adapter: DATABASE_URL=postgres://...
  # silently undid `adapter: neverblock_postgresql`. Warn, with the scheme
  # that keeps it; with that scheme the neverblock adapter is used.
  def test_database_url_overriding_the_neverblock_adapter_is_reported_with_the_fix
    Dir.mktmpdir("nb-railtie") do |root|
      FileUtils.mkdir_p(File.join(root, "config"))
      File.write(File.join(root, "config", "database.yml"), <<~YAML)
        production:
          adapter: neverblock_postgresql
          pool: 20
      YAML
      code = <<~RUBY
        require "rails"
        require "active_record/railtie"
        require "neverblock"
        class App < Rails::Application
          config.eager_load = false
          config.logger = Logger.new(nil)
          config.secret_key_base = "x" * 64
          config.root = #{root.inspect}
        end
        App.initialize!
        puts ActiveRecord::Base.connection_db_config.adapter
      RUBY
      env = { "RAILS_ENV" => "production", "DATABASE_URL" => "postgres://app:secret@127.0.0.1:1/app" }
      out, err, status = run_ruby(code, timeout: 60, env: env)
      assert status.success?, err
      assert_equal "postgresql\n", out
      assert_match(/says adapter: neverblock_postgresql for "primary" \(production\), but its URL .* names "postgresql".*neverblock-postgresql:\/\//, err)

      out, err, status = run_ruby(code, timeout: 60, env: env.merge("DATABASE_URL" => "neverblock-postgresql://app:secret@127.0.0.1:1/app"))
      assert status.success?, err
      assert_equal "neverblock_postgresql\n", out
      refute_match(/URL wins/, err)
    end
  end

  def test_an_app_that_configures_thread_isolation_explicitly_keeps_its_choice
    level, = boot(requires: "require 'rails'\nrequire 'active_record/railtie'\nrequire 'neverblock/active_record'",
                  config: "config.active_support.isolation_level = :thread")
    assert_equal "thread", level
  end
end
