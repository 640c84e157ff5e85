# frozen_string_literal: true

require_relative "test_helper"
require "fileutils"
require "shellwords"
require "tmpdir"
require "yaml"

# README.md and docs/*.md as a new user reads them: every fenced code block
# is run as written, against real servers (bin/test's PostgreSQL, MariaDB and
# Redis), and every relative link leads to a file and heading that exist.
#
# Each block is preceded by a comment saying how it is checked:
#
#   <!-- readme-test: KIND option=value flag ... -->
#
# script         a Ruby program: run in an empty directory with DATABASE_URL,
#                MYSQL_URL and REDIS_URL set; `max=S` it must end within S
#                seconds of its first NeverBlock.run (the concurrency it
#                shows; test/support/readme_timing.rb), `expect=REGEX` on its
#                stdout, `upstream` a slow HTTP service on 127.0.0.1:8080
#                (GET /slow answers after 1 s) while it runs.
# rspec          an RSpec file: run with `rspec`; `expect=REGEX` on its output.
# rackup         a config.ru: served by `neverblock serve`; `path=` is
#                requested (default /), `status=` expected (default 200).
# serve_config   a `neverblock serve -C` file: served with a config.ru that
#                uses ActiveRecord, on the port the file names.
# gemfile        Gemfile lines: evaluated by Bundler; they must select this
#                NeverBlock and never the 2010 gem (0.1.6.2).
# database_yml   a config/database.yml: its first environment, pointed at the
#                test database, connects and queries.
# commands       shell commands that start a server: each is run in an app
#                directory, must answer on its port, and stops on TERM.
# synopsis       command synopses: every option listed must be one that the
#                subcommand's --help lists.
# shown          not run, with `reason=` saying why (bin/test itself, the
#                benchmarks that take minutes).
#
# A block without the comment fails: no documented code goes unchecked.
class ReadmeTest < PlainTest
  include NeverBlockTest::Databases
  include ServerProcess

  ROOT = File.expand_path("..", __dir__)
  RAILS_FIXTURE = File.join(__dir__, "fixtures", "server", "rails_app")
  KINDS = %w[script rspec rackup serve_config gemfile database_yml commands synopsis shown].freeze

  Block = Struct.new(:file, :line, :language, :code, :kind, :options) do
    def name
      "#{file}:#{line} (#{language} #{kind})"
    end

    # A test-method-friendly name of the file: readme, docs_server...
    def source
      file.delete_suffix(".md").downcase.gsub(/[^a-z0-9]+/, "_")
    end
  end

  # @return [Array<String>] README.md, then docs/*.md by name, as paths
  #   relative to ROOT.
  def self.documents
    ["README.md"] + Dir.glob("docs/*.md", base: ROOT).sort
  end

  # @return [Array<Block>] every document's fenced blocks, in order.
  def self.blocks
    documents.flat_map { |document| blocks_of(document) }
  end

  # @param document [String] a path relative to ROOT
  # @return [Array<Block>] the document's fenced blocks, in order.
  def self.blocks_of(document)
    lines = File.readlines(File.join(ROOT, document), chomp: true)
    blocks = []
    index = 0
    while index < lines.size
      if (fence = lines[index][/\A```(\w*)\z/, 1])
        start = index
        index += 1
        index += 1 until index >= lines.size || lines[index] == "```"
        code = lines[(start + 1)...index].join("\n") << "\n"
        marker = lines[0...start].reverse.find { |line| !line.strip.empty? }.to_s
        kind, options = parse_marker(marker)
        blocks << Block.new(document, start + 1, fence.empty? ? "unlabelled" : fence, code, kind, options)
      end
      index += 1
    end
    blocks
  end

  def self.parse_marker(line)
    words = line[/\A<!-- readme-test: (.*) -->\z/, 1]
    return [nil, {}] unless words

    kind, *rest = Shellwords.split(words)
    options = rest.to_h { |word| word.include?("=") ? word.split("=", 2) : [word, true] }
    [kind, options]
  end

  blocks.each do |block|
    define_method("test_#{block.kind || 'unmarked'}_block_at_#{block.source}_line_#{block.line}") do
      assert_includes KINDS, block.kind,
                      "#{block.name}: precede the block with <!-- readme-test: KIND ... --> (KIND: #{KINDS.join(', ')})"
      send("check_#{block.kind}", block)
    end
  end

  def test_the_documents_have_blocks_of_every_kind_they_rely_on
    kinds = self.class.blocks.map(&:kind)
    %w[script rackup commands].each { |kind| assert_includes kinds, kind }
  end

  # README's table of documents lists every file in docs/.
  def test_the_readme_links_every_document
    linked = links("README.md").map { |target, _anchor| target }
    (self.class.documents - ["README.md"]).each do |document|
      assert_includes linked, document, "README.md does not link #{document}"
    end
  end

  # A moved section leaves no dead link behind: every relative link names a
  # file that exists and, with a #fragment, a heading of that file.
  def test_every_relative_link_and_anchor_resolves
    self.class.documents.each do |document|
      links(document).each do |target, anchor|
        assert File.exist?(File.join(ROOT, target)), "#{document}: link to #{target}, which does not exist"
        next unless anchor && target.end_with?(".md")

        assert anchors(target).include?(anchor), "#{document}: link to #{target}##{anchor}, which has no such heading"
      end
    end
  end

  # The documents' examples use the ports a user would type (8080, 9292,
  # 3000, ...), so two suites running at once on this machine (bin/test
  # --jobs, or another checkout's) take turns: one block at a time. The
  # turn is an abstract unix socket's name, held while bound: the chroots
  # share the host's network namespace, and the kernel releases it with
  # the process, however that ends.
  PORTS_TURN = "\0neverblock-readme-ports"

  def setup
    super
    deadline = now + 900
    begin
      @ports_turn = Socket.new(:UNIX, :STREAM)
      @ports_turn.bind(Socket.pack_sockaddr_un(PORTS_TURN))
    rescue Errno::EADDRINUSE
      @ports_turn.close
      raise "another suite held the documents' ports for 15 minutes" if now > deadline

      sleep 0.1
      retry
    end
  end

  def teardown
    @upstream&.close
    @upstream_thread&.kill
    super
    FileUtils.rm_rf(@dir) if @dir
  ensure
    @ports_turn&.close # the next suite's turn
  end

  private

  # --- the kinds -----------------------------------------------------------

  def check_script(block)
    @dir = Dir.mktmpdir("nb-readme")
    File.write(File.join(@dir, "example.rb"), block.code)
    start_upstream if block.options["upstream"]
    timing = File.join(@dir, ".timing") # see test/support/readme_timing.rb
    timed = block.options["max"] ? ["-r", File.join(__dir__, "support", "readme_timing.rb")] : []
    started = now
    out, err, status = run_in(@dir, RbConfig.ruby, "-I", File.join(ROOT, "lib"), *timed, "example.rb",
                              timeout: Float(block.options.fetch("timeout", 90)), env: { "NEVERBLOCK_README_TIMING" => timing })
    took = File.exist?(timing) ? Float(File.read(timing)) : now - started
    assert status.success?, "#{block.name} failed (#{status.inspect}):\n#{out}\n#{err}"
    if (max = block.options["max"])
      assert_operator took, :<, Float(max), "#{block.name} took #{took.round(2)} s from its first NeverBlock.run:\n#{out}"
    end
    assert_match Regexp.new(block.options["expect"]), out, block.name if block.options["expect"]
  end

  def check_rspec(block)
    @dir = Dir.mktmpdir("nb-readme")
    File.write(File.join(@dir, "example_spec.rb"), block.code)
    out, err, status = run_in(@dir, RbConfig.ruby, "-I", File.join(ROOT, "lib"), Gem.bin_path("rspec-core", "rspec"),
                              "example_spec.rb")
    assert status.success?, "#{block.name} failed:\n#{out}\n#{err}"
    assert_match Regexp.new(block.options["expect"]), out, block.name if block.options["expect"]
  end

  def check_rackup(block)
    @dir = Dir.mktmpdir("nb-readme")
    File.write(File.join(@dir, "config.ru"), block.code)
    start_upstream if block.options["upstream"]
    port = free_port
    start(RbConfig.ruby, File.join(ROOT, "exe", "neverblock"), "serve", "config.ru", "-b", "tcp://127.0.0.1:#{port}",
          "-w", "0", chdir: @dir, env: readme_env)
    response = wait_for_answer(port, block.options.fetch("path", "/"))
    assert_equal block.options.fetch("status", "200"), response.code, "#{block.name}:\n#{response.body}\n#{output}"
    assert_match Regexp.new(block.options["expect"]), response.body, block.name if block.options["expect"]
    assert stop_and_wait("TERM").success?, output
  end

  def check_serve_config(block)
    @dir = app_directory
    File.write(File.join(@dir, "config", "neverblock.rb"), block.code)
    port = Integer(block.code[/^port (\d+)/, 1])
    start(RbConfig.ruby, File.join(ROOT, "exe", "neverblock"), "serve", "-C", "config/neverblock.rb",
          chdir: @dir, env: readme_env)
    response = wait_for_answer(port)
    assert_equal ["200", "1\n"], [response.code, response.body], output
    pidfile = block.code[/^pidfile "([^"]+)"/, 1]
    assert_equal @pid, Integer(File.read(File.expand_path(pidfile, File.join(@dir, "config")))) if pidfile
    assert stop_and_wait("TERM").success?
    log = block.code[/^log "([^"]+)"/, 1]
    assert_match(/worker 0 booting/, File.read(File.expand_path(log, File.join(@dir, "config")))) if log
  end

  def check_gemfile(block)
    require "bundler"
    dsl = Bundler::Dsl.new
    dsl.instance_eval(block.code, block.file, block.line + 1)
    dependencies = dsl.dependencies.select { |dependency| dependency.name == "neverblock" }
    refute_empty dependencies, block.name
    dependencies.each do |dependency|
      assert dependency.requirement.satisfied_by?(Gem::Version.new(NeverBlock::VERSION)), "#{block.name}: #{dependency}"
      refute dependency.requirement.satisfied_by?(Gem::Version.new("0.1.6.2")), "#{block.name} allows the 2010 gem"
    end
  end

  def check_database_yml(block)
    config = YAML.safe_load(block.code).values.first
    url = pg_url.sub(/\Apostgres/, config.fetch("adapter").tr("_", "-")) # a URL scheme has no "_"
    code = <<~RUBY
      require "active_record"
      require "neverblock"
      ActiveRecord::Base.establish_connection(#{config.merge('url' => url).inspect})
      NeverBlock.run do
        puts ActiveRecord::Base.connection.select_value("select 1")
        puts ActiveRecord::Base.connection.class
        puts ActiveRecord::Base.connection_pool.size
      end
    RUBY
    out, err, status = run_in(ROOT, RbConfig.ruby, "-I", File.join(ROOT, "lib"), "-e", code)
    assert status.success?, "#{block.name}:\n#{out}\n#{err}"
    # Rails 8.1 reads max_connections: (pool: before it; 7.2 ignores the new key).
    pool = config["pool"] || (config["max_connections"] if Gem.loaded_specs["activerecord"].version >= Gem::Version.new("8.1"))
    assert_equal ["1", (pool || 5).to_s], [out.lines[0].chomp, out.lines[2].chomp]
    assert_match(/NeverBlock/, out.lines[1], "the neverblock adapter is the one in use")
  end

  def check_commands(block)
    commands(block.code).each do |command|
      @dir = command.include?("bin/rails") ? rails_directory : app_directory
      port = Integer(command[/(?:-p |tcp:\/\/[\d.]+:)(\d+)/, 1] || (command.include?("bin/rails") ? 3000 : 9292))
      start("/bin/sh", "-c", "exec #{command}", chdir: @dir, env: readme_env)
      response = wait_for_answer(port, timeout: 90)
      assert_equal "200", response.code, "#{block.name}: #{command}\n#{output}"
      status = stop_and_wait("TERM")
      assert status.success? || status.termsig == Signal.list["TERM"], "#{command}: #{status.inspect}\n#{output}"
      FileUtils.rm_rf(@dir)
    end
  end

  def check_synopsis(block)
    commands(block.code).each do |command|
      words = Shellwords.split(command.tr("[]", "  "))
      subcommand = words[1]
      next unless subcommand&.match?(/\A[a-z]+\z/)

      help, _err, status = run_in(ROOT, RbConfig.ruby, File.join(ROOT, "exe", "neverblock"), subcommand, "--help")
      assert status.success?, "neverblock #{subcommand} --help"
      words.grep(/\A--?[a-zA-Z]/).each do |option|
        assert_match(/(?<![\w-])#{Regexp.escape(option)}(?![\w-])/, help, "#{block.name}: `neverblock #{subcommand}` has no #{option}")
      end
    end
  end

  def check_shown(block)
    assert block.options["reason"].is_a?(String), "#{block.name}: a block that is not run says why (reason=...)"
  end

  # --- helpers -------------------------------------------------------------

  # The document's lines outside fenced code blocks.
  def prose(document)
    fenced = false
    File.readlines(File.join(ROOT, document), chomp: true).reject do |line|
      fenced = !fenced if line.start_with?("```")
      fenced || line.start_with?("```")
    end
  end

  # @return [Array<(String, String)>] the document's relative links as
  #   [path relative to ROOT, anchor or nil]; a bare #anchor is the document's.
  def links(document)
    prose(document).join("\n").scan(/\]\(([^)\s]+)\)/).flatten.filter_map do |href|
      next if href.match?(/\A[a-z]+:/)

      path, anchor = href.split("#", 2)
      next [document, anchor] if path.empty?

      [File.expand_path(path, File.join(ROOT, File.dirname(document))).delete_prefix("#{ROOT}/"), anchor]
    end
  end

  # The anchors GitHub gives the document's headings: lower case, punctuation
  # dropped, spaces as hyphens, -1, -2... after repeats.
  def anchors(document)
    seen = Hash.new(0)
    prose(document).grep(/\A#+ /).map do |heading|
      slug = heading.sub(/\A#+ /, "").strip.downcase.gsub(/[^\p{Word}\- ]/, "").tr(" ", "-")
      seen[slug] += 1
      seen[slug] == 1 ? slug : "#{slug}-#{seen[slug] - 1}"
    end
  end

  # The block's commands: `\` continuations joined, comments and
  # `bundle exec` (we run inside this bundle already) kept as typed.
  def commands(code)
    code.gsub(/\\\n\s*/, " ").lines.map { |line| line.sub(/\s+#.*\z/, "").strip }.reject(&:empty?)
  end

  def readme_env
    mysql = mysql_config
    {
      "DATABASE_URL" => pg_url,
      "MYSQL_URL" => "mysql://#{ERB::Util.url_encode(mysql[:username])}:#{ERB::Util.url_encode(mysql[:password])}" \
                     "@#{mysql[:host]}:#{mysql[:port]}/#{mysql[:database]}",
      "REDIS_URL" => redis_url
    }
  end

  def run_in(dir, *command, timeout: 90, env: {})
    child_process(*command, env: readme_env.merge(env), chdir: dir, timeout: timeout)
  end

  # An app directory as `neverblock serve` expects one: a config.ru that
  # counts users through ActiveRecord, config/, log/, tmp/pids/.
  def app_directory
    dir = Dir.mktmpdir("nb-readme-app")
    FileUtils.mkdir_p(%w[config log tmp/pids].map { |sub| File.join(dir, sub) })
    File.write(File.join(dir, "config", "neverblock.rb"), "workers 1\n")
    File.write(File.join(dir, "config.ru"), <<~RUBY)
      require "active_record"
      require "neverblock"
      ActiveRecord::Base.establish_connection(ENV.fetch("DATABASE_URL").sub(/\\Apostgres(ql)?:/, "neverblock-postgresql:"))
      run ->(_env) { [200, { "content-type" => "text/plain" }, ["\#{ActiveRecord::Base.connection.select_value('select 1')}\\n"]] }
    RUBY
    dir
  end

  def rails_directory
    dir = Dir.mktmpdir("nb-readme-rails")
    FileUtils.cp_r(File.join(RAILS_FIXTURE, "."), dir)
    dir
  end

  # A slow HTTP service on 127.0.0.1:8080, as the documents' examples assume:
  # GET /slow answers "slow" after 1 s, anything else at once.
  def start_upstream
    @upstream = TCPServer.new("127.0.0.1", 8080)
    @upstream_thread = Thread.new do
      loop do
        client = @upstream.accept
        Thread.new(client) { |socket| answer_upstream(socket) }
      end
    rescue IOError
      nil
    end
  rescue Errno::EADDRINUSE
    flunk "127.0.0.1:8080 is in use: the documents' examples need it for their upstream"
  end

  def answer_upstream(socket)
    while (request_line = socket.gets)
      while (line = socket.gets) && line != "\r\n"; end # the headers
      sleep 1 if request_line.include?("/slow")
      body = request_line.include?("/slow") ? "slow\n" : "upstream\n"
      socket.write("HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: #{body.bytesize}\r\n\r\n#{body}")
    end
  rescue IOError, SystemCallError
    nil
  ensure
    socket.close
  end
end
