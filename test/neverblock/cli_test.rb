# frozen_string_literal: true

require "test_helper"
require "open3"
require "tmpdir"

# exe/neverblock.
class CLITest < PlainTest
  EXE = File.expand_path("../../exe/neverblock", __dir__)

  def neverblock(*args)
    Open3.capture3(RbConfig.ruby, EXE, *args)
  end

  def test_version
    out, _err, status = neverblock("version")
    assert status.success?
    assert_equal "neverblock #{NeverBlock::VERSION}\n", out
  end

  def test_help
    out, _err, status = neverblock("help")
    assert status.success?
    assert_match(/Usage: neverblock COMMAND/, out)
  end

  def test_unknown_command_is_a_usage_error
    _out, err, status = neverblock("frobnicate")
    assert_equal 64, status.exitstatus
    assert_match(/unknown command "frobnicate"/, err)
  end

  def test_run_executes_a_script_inside_the_loop_with_its_arguments
    Dir.mktmpdir do |dir|
      script = File.join(dir, "script.rb")
      File.write(script, <<~RUBY)
        started = NeverBlock::Clock.now
        3.times.map { NeverBlock.spawn { sleep 0.2 } }.each(&:wait)
        took = NeverBlock::Clock.now - started
        puts [NeverBlock.neverblocking?, ARGV, took < 0.5].inspect
      RUBY
      out, err, status = neverblock("run", script, "a", "b")
      assert status.success?, err
      assert_equal "[true, [\"a\", \"b\"], true]\n", out
    end
  end

  def test_run_a_missing_file_is_a_usage_error
    _out, err, status = neverblock("run", "/nonexistent.rb")
    assert_equal 64, status.exitstatus
    assert_match(/no such file/, err)
  end

  def test_dash_e_runs_code_inside_the_loop
    out, err, status = neverblock("-e", "p NeverBlock.neverblocking?")
    assert status.success?, err
    assert_equal "true\n", out
  end

  # `if __FILE__ == $0` (the script-or-library idiom) holds under `neverblock run`, given a relative path.
  def test_run_keeps_the_file_equals_program_name_idiom
    Dir.mktmpdir do |dir|
      File.write(File.join(dir, "main.rb"), "puts(__FILE__ == $0 ? 'main' : 'library')\n")
      out, err, status = Open3.capture3(RbConfig.ruby, EXE, "run", "main.rb", chdir: dir)
      assert status.success?, err
      assert_equal "main\n", out
    end
  end

  # Ruby 3.1's error_highlight lost the message of an exception from code
  # evaluated under the file name "-e".
  def test_dash_e_keeps_the_exception_message
    _out, err, status = neverblock("-e", "nil.frobnicate")
    refute status.success?
    assert_match(/undefined method [`']frobnicate' for nil/, err)
  end

  def test_every_subcommand_has_help
    [%w[run --help], %w[-e --help], %w[version -h], %w[serve --help], %w[debounce --help]].each do |args|
      out, err, status = neverblock(*args)
      assert status.success?, "#{args.join(' ')}: #{err}"
      assert_match(/\AUsage: neverblock #{Regexp.escape(args.first)}/, out)
    end
  end

  # The command line was right: a mistyped setting in the -C file is its
  # error (file and line) and where the settings are listed, not --help.
  def test_a_mistyped_config_setting_prints_its_error_and_where_the_settings_are_listed
    Dir.mktmpdir do |dir|
      File.write(File.join(dir, "config.ru"), "run ->(_env) { [200, {}, []] }\n")
      config = File.join(dir, "neverblock.rb")
      File.write(config, "workers 2\nworker 5\n")
      _out, err, status = neverblock("serve", File.join(dir, "config.ru"), "-C", config)
      assert_equal 64, status.exitstatus
      docs = File.expand_path("../../docs/server.md", __dir__)
      lines = err.lines(chomp: true)
      assert_equal 2, lines.size, err
      assert_match(/\Aneverblock serve: #{Regexp.escape(config)}:2: unknown setting worker \(known: .*workers/, lines[0])
      assert_equal "The settings a config file takes are listed in #{docs}, \"The config file\".", lines[1]
      assert File.file?(docs)
    end
  end

  def test_a_bad_size_in_the_config_file_names_the_file
    Dir.mktmpdir do |dir|
      File.write(File.join(dir, "config.ru"), "run ->(_env) { [200, {}, []] }\n")
      config = File.join(dir, "neverblock.rb")
      File.write(config, "max_memory \"1Q\"\n")
      _out, err, status = neverblock("serve", File.join(dir, "config.ru"), "-C", config)
      assert_equal 64, status.exitstatus
      assert_equal "neverblock serve: #{config}: max_memory 1Q (bytes, or a number with K, M or G)", err.lines.first.chomp
      refute_match(/Usage:/, err)
    end
  end

  def test_an_exception_in_the_script_fails_the_command
    _out, err, status = neverblock("-e", "raise 'script failed'")
    refute status.success?
    assert_match(/script failed/, err)
  end
end
