# frozen_string_literal: true

require_relative "../test_helper"
require_relative "../support/serve_processes"
require "fileutils"
require "open3"
require "socket"

# A new user's walk: a fresh `rails new APP -d postgresql` (Rails 8.1), given
# only what docs/rails.md tells a user (the Gemfile line, one word in
# database.yml, one line in the Dockerfile), started as its generated
# Dockerfile starts it (bin/docker-entrypoint, which runs `bin/rails
# db:prepare`, then `./bin/thrust ./bin/rails server`) in production with
# Kamal's SOLID_QUEUE_IN_PUMA, against the PostgreSQL bin/test starts.
# Through Thruster: twenty one-second queries at once take about a second,
# a job is performed by Solid Queue under NeverBlock's master (no bin/jobs
# started by hand), Thruster speaks HTTP/2 without TLS when H2C_ENABLED is
# set, and TERM to Thruster drains the requests in flight and stops every
# process of the tree.
#
# Runs on the Ruby 3.4 pass on the default selector (epoll) only: Rails 8.1
# needs Ruby 3.2+ (not 3.1), the generated Dockerfile pins the Ruby that ran
# `rails new`, and one walk per CI run is enough; the 3.4 passes on uring
# and select run beside it (bin/test --jobs) and would walk in the same
# tmp/rails-new at the same time. It takes about 100 s on a fresh machine, 74 of them
# `rails new` (its bundle install fetches and builds what the project's
# bundle lacks: rails 8.1.4's gems, puma, bootsnap, kamal, propshaft...),
# and about 26 s afterwards: the generated app's gems go to
# tmp/rails-new-bundle-3.4, seeded with hard links from the project's 3.4
# bundle and kept between runs.
class RailsNewProductionTest < PlainTest
  include ServeProcesses
  include NeverBlockTest::Databases

  REPO = File.expand_path("../..", __dir__)
  WORK = File.join(REPO, "tmp", "rails-new")
  BUNDLE = File.join(REPO, "tmp", "rails-new-bundle-3.4")
  NAME = "nbwalk"
  APP = File.join(WORK, NAME)
  PASSWORD = "walk-#{Process.pid}"

  # What `rails new` skips, each because production does not use it (the
  # Dockerfile's bundle has BUNDLE_WITHOUT=development): the app's own
  # tests and system tests (capybara, selenium), linters and scanners
  # (rubocop, brakeman, bundler-audit), the GitHub CI workflow, and a git
  # repository inside this one. Kamal stays (config/deploy.yml sets
  # SOLID_QUEUE_IN_PUMA), as do Thruster, Solid Queue/Cache/Cable,
  # bootsnap, propshaft and importmap (assets to precompile).
  SKIPS = %w[--skip-git --skip-test --skip-system-test --skip-rubocop --skip-brakeman --skip-bundler-audit --skip-ci].freeze

  def setup
    super
    skip "Rails 8.1 needs Ruby 3.2+" if RUBY_VERSION < "3.2"
    unless RUBY_VERSION.start_with?("3.4.") && !yjit? && ENV.fetch("NEVERBLOCK_SELECTOR", "epoll") == "epoll"
      skip "runs on the Ruby 3.4 epoll pass only (one walk per CI run; passes run side by side share tmp/rails-new)"
    end
    %w[railties thruster solid_queue].each do |gem|
      flunk "#{gem} is missing from the 3.4 bundle (gemfiles/ruby34.gemfile)" unless bundled?(gem)
    end
    @pg = pg_conninfo
    admin { |conn| drop_all(conn) }
    admin { |conn| conn.exec("CREATE ROLE #{NAME} LOGIN CREATEDB PASSWORD '#{PASSWORD}'") }
  end

  def teardown
    super
    admin { |conn| drop_all(conn) } if @pg
  end

  def test_a_new_rails_app_reaches_production_behind_thruster_with_solid_queue
    timings = {}
    timings[:rails_new] = timed { rails_new }
    timings[:docs] = timed { follow_the_docs }
    write_probes
    timings[:assets] = timed { run!(production_env, "bin/rails", "assets:precompile", env: { "SECRET_KEY_BASE_DUMMY" => "1" }) }
    timings[:boot] = timed { start_as_the_container }

    started = now
    bodies = Array.new(20) { Thread.new { http_get("/probe/sleep").body } }.map(&:value)
    took = now - started
    assert_equal ["slept\n"] * 20, bodies
    # One after the other they take 20 s; at once about 1 s, and up to 6 s on a
    # machine running three test suites (the app's first requests: twenty
    # database connections opened, code loaded on first use).
    assert_operator took, :<, 10, "twenty pg_sleep(1) through Thruster took #{took.round(2)} s: not concurrent"

    assert_equal "enqueued\n", http_get("/probe/enqueue?note=walk").body
    eventually(timeout: 60) { http_get("/probe/visits").body == "walk\n" }
    assert_match(/supervising `bin\/jobs` \(pid \d+\)/, output, "Solid Queue under NeverBlock's master")

    assert_h2c

    in_flight = Array.new(5) { Thread.new { http_get("/probe/sleep") } }
    eventually { requests_in_the_database >= 5 }
    tree = descendants_of(@thruster[:pid])
    assert_operator tree.size, :>=, 4, "thrust, the master, a worker, bin/jobs and its forks: #{tree}"
    Process.kill("TERM", @thruster[:pid])
    assert_equal [["200", "slept\n"]] * 5, in_flight.map { |thread| [thread.value.code, thread.value.body] }, "drained"
    assert wait_exit(@thruster, timeout: 60).success?, output
    eventually(timeout: 30) { tree.none? { |pid| alive?(pid) } }
    $stderr.puts("\n#{self.class}: #{timings.transform_values { |seconds| seconds.round(1) }} s")
  end

  private

  def yjit?
    defined?(RubyVM::YJIT) && RubyVM::YJIT.enabled?
  end

  def bundled?(name)
    Bundler.locked_gems.specs.any? { |spec| spec.name == name }
  end

  def timed
    started = now
    yield
    now - started
  end

  # The project's bundle, linked (not copied) into the app's: `rails new`'s
  # bundle install then fetches only the gems the project does not have.
  # bin/ is copied: Bundler rewrites its stubs in place.
  def seed_bundle
    gems = File.join(BUNDLE, "ruby", Gem.ruby_api_version)
    return gems if File.directory?(gems)

    FileUtils.mkdir_p(File.dirname(gems))
    system("cp", "-al", Bundler.bundle_path.to_s, gems, exception: true)
    FileUtils.rm_rf(File.join(gems, "bin"))
    FileUtils.cp_r(File.join(Bundler.bundle_path, "bin"), File.join(gems, "bin"))
    gems
  end

  # The environment a user's shell has: no trace of this project's bundle.
  def user_env(extra = {})
    base = Bundler.with_original_env { ENV.to_h }
    base.merge("BUNDLE_GEMFILE" => nil, "BUNDLE_FROZEN" => nil, "BUNDLE_PATH" => BUNDLE, "RUBYOPT" => nil,
               "RAILS_ENV" => nil, "RACK_ENV" => nil, "DATABASE_URL" => nil, "RAILS_MAX_THREADS" => nil).merge(extra)
  end

  def run!(base, *command, env: {}, chdir: APP)
    output, status = Open3.capture2e(base.merge(env), *command, chdir: chdir, unsetenv_others: true)
    assert status.success?, "#{command.join(' ')} failed:\n#{output}"
    output
  end

  def rails_new
    gems = seed_bundle
    FileUtils.rm_rf(APP)
    FileUtils.mkdir_p(WORK)
    # The registry this was written against lacks actionmailbox 8.1.4.1 (a
    # security release), which `gem "rails", "~> 8.1.4", ">= 8.1.4.1"`
    # needs: the template, applied before `rails new` bundles, keeps the
    # same minor (`~> 8.1.4`) and lets Bundler take the release it can get.
    template = File.join(WORK, "template.rb")
    File.write(template, <<~'RUBY')
      gsub_file "Gemfile", /^gem "rails", "~> ([\d.]+)", ">= [\d.]+"$/, 'gem "rails", "~> \1"'
    RUBY
    run!(user_env("GEM_PATH" => gems), RbConfig.ruby, File.join(gems, "bin", "rails"), "new", NAME,
         "--database=postgresql", "--template=#{template}", *SKIPS, chdir: WORK)
    %w[bin/jobs bin/thrust bin/docker-entrypoint config/deploy.yml config/queue.yml db/queue_schema.rb].each do |file|
      assert File.exist?(File.join(APP, file)), "rails new wrote no #{file}"
    end
  end

  # docs/rails.md, verbatim: its Gemfile line (with `path:` this checkout
  # instead of `git:`), its one word in database.yml, its Dockerfile line.
  def follow_the_docs
    docs = File.read(File.join(REPO, "docs/rails.md"))
    line = docs[/^gem "neverblock".*$/] or flunk "docs/rails.md has no Gemfile line"
    File.write(File.join(APP, "Gemfile"), "\n#{line.sub(/git: "[^"]*"/, "path: #{REPO.dump}")}\n", mode: "a")
    run!(user_env, "bundle", "install")

    database_yml = File.join(APP, "config/database.yml")
    generated = File.read(database_yml)
    assert_equal 1, generated.scan(/^  adapter: postgresql$/).size, generated
    File.write(database_yml, generated.sub(/^  adapter: postgresql$/, "  adapter: neverblock_postgresql"))

    dockerfile = File.join(APP, "Dockerfile")
    generated = File.read(dockerfile)
    assert_includes generated, %(CMD ["./bin/thrust", "./bin/rails", "server"]\n)
    env_line = docs[/^ENV RACKUP_HANDLER=.*$/] or flunk "docs/rails.md has no Dockerfile ENV line"
    File.write(dockerfile, generated.sub(/^CMD /, "#{env_line}\nCMD "))
    @command = JSON.parse(generated[/^CMD (\[.*\])$/, 1])
  end

  # A model, a job that writes it, and a controller: /probe/sleep spends a
  # second in PostgreSQL, /probe/enqueue enqueues the job, /probe/visits
  # lists what jobs wrote. ActionController::Base rather than the
  # generated ApplicationController, whose `allow_browser versions:
  # :modern` answers 406 to a client without a browser's User-Agent.
  def write_probes
    run!(user_env, "bin/rails", "generate", "model", "Visit", "note:string")
    run!(user_env, "bin/rails", "generate", "job", "RecordVisit")
    File.write(File.join(APP, "app/jobs/record_visit_job.rb"), <<~RUBY)
      class RecordVisitJob < ApplicationJob
        queue_as :default

        def perform(note)
          Visit.create!(note: note)
        end
      end
    RUBY
    File.write(File.join(APP, "app/controllers/probes_controller.rb"), <<~RUBY)
      class ProbesController < ActionController::Base
        def sleep
          ActiveRecord::Base.connection.select_value("select pg_sleep(1)")
          render plain: "slept\\n"
        end

        def enqueue
          RecordVisitJob.perform_later(params.require(:note))
          render plain: "enqueued\\n"
        end

        def visits
          render plain: Visit.order(:id).pluck(:note).map { |note| "\#{note}\\n" }.join
        end
      end
    RUBY
    routes = File.join(APP, "config/routes.rb")
    File.write(routes, File.read(routes).sub("Rails.application.routes.draw do\n", <<~RUBY))
      Rails.application.routes.draw do
        get "probe/sleep" => "probes#sleep"
        get "probe/enqueue" => "probes#enqueue"
        get "probe/visits" => "probes#visits"
    RUBY
  end

  # As the Dockerfile's ENV and Kamal's deploy.yml set them, plus the
  # database: the generated production config names role NAME, with
  # NAME_DATABASE_PASSWORD, and no host (libpq's PGHOST and PGPORT).
  def production_env
    dockerfile = File.read(File.join(APP, "Dockerfile"))
    handler = dockerfile[/^ENV RACKUP_HANDLER="?(\w+)"?$/, 1]
    user_env("RAILS_ENV" => "production", "BUNDLE_WITHOUT" => "development", "RACKUP_HANDLER" => handler,
             "SECRET_KEY_BASE" => "0" * 128, "SOLID_QUEUE_IN_PUMA" => "true",
             "PGHOST" => @pg[:host], "PGPORT" => @pg[:port].to_s, "#{NAME.upcase}_DATABASE_PASSWORD" => PASSWORD)
  end

  # `docker run`: the entrypoint, then the Dockerfile's CMD. Thruster
  # listens on HTTP_PORT (80 in the container) and starts the server with
  # PORT set to TARGET_PORT (3000 in the container).
  def start_as_the_container
    @port = free_port
    env = production_env.merge("HTTP_PORT" => @port.to_s, "TARGET_PORT" => free_port.to_s, "H2C_ENABLED" => "true")
    reader, writer = IO.pipe
    pid = Process.spawn(env, "bin/docker-entrypoint", *@command, chdir: APP, unsetenv_others: true,
                                                                  out: writer, err: writer, pgroup: true)
    writer.close
    @thruster = { pid: pid, out: reader, lines: [] }
    (@servers ||= []) << @thruster
    read_output(reader)
    eventually(timeout: 120) { output.include?("Booting NeverBlock") } # past db:prepare
    eventually(timeout: 60) { up? }
  end

  # Thruster's output (its own log and the server's) read as it comes: a
  # pipe left unread fills up after a hundred requests' log lines, and then
  # the app's logger blocks the requests that log.
  def read_output(reader)
    @output = +""
    @output_lock = Mutex.new
    @output_reader = Thread.new do
      while (chunk = reader.readpartial(65_536))
        @output_lock.synchronize { @output << chunk }
      end
    rescue EOFError, IOError
      nil
    end
  end

  def output
    @output_lock.synchronize { @output.dup }
  end

  # A failed #eventually shows what the server said.
  def failure_context = "; output:\n#{@output_lock ? output : '(not started)'}"

  def up?
    http_get("/up").code == "200"
  rescue SystemCallError, EOFError, Net::ReadTimeout
    false
  end

  def http_get(path)
    Net::HTTP.start("127.0.0.1", @port, open_timeout: 5, read_timeout: 30) { |http| http.get(path) }
  end

  # HTTP/2 with prior knowledge (h2c): the client preface, an empty
  # SETTINGS frame and a HEADERS frame for GET /up (HPACK: static-table
  # :method GET, :scheme http, then :path and :authority as literals);
  # the answer must be HTTP/2 frames with :status 200 (static index 8).
  def assert_h2c
    socket = TCPSocket.new("127.0.0.1", @port)
    authority = "127.0.0.1:#{@port}"
    block = [0x82, 0x86].pack("C*") + [0x04, 3].pack("C*") + "/up" + [0x01, authority.bytesize].pack("C*") + authority
    socket.write("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", frame(4, 0, 0, ""), frame(1, 0x5, 1, block))
    Timeout.timeout(10) do
      loop do
        length, type, _flags, stream = read_frame_head(socket)
        payload = socket.read(length)
        next unless type == 1 && stream == 1 # HEADERS of our stream

        assert_equal 0x88, payload.getbyte(0), "HTTP/2 :status 200"
        break
      end
    end
  ensure
    socket&.close
  end

  def frame(type, flags, stream, payload)
    [payload.bytesize >> 16, payload.bytesize & 0xffff, type, flags, stream].pack("CnCCN") + payload.b
  end

  def read_frame_head(socket)
    head = socket.read(9) or flunk "Thruster closed the HTTP/2 connection"
    high, low, type, flags, stream = head.unpack("CnCCN")
    [(high << 16) | low, type, flags, stream & 0x7fffffff]
  end

  def requests_in_the_database
    admin do |conn|
      conn.exec("SELECT count(*) FROM pg_stat_activity WHERE usename = '#{NAME}' AND query LIKE '%pg_sleep(1)%' " \
                "AND state = 'active'").getvalue(0, 0).to_i
    end
  end

  def descendants_of(pid)
    children = worker_pids(pid)
    [pid] + children.flat_map { |child| descendants_of(child) }
  end

  def admin
    require "pg"
    conn = PG.connect(**@pg)
    conn.exec("SET client_min_messages TO warning") # no NOTICE for a DROP ... IF EXISTS that finds nothing
    yield conn
  ensure
    conn&.close
  end

  def drop_all(conn)
    %w[production production_cache production_queue production_cable].each do |suffix|
      conn.exec("DROP DATABASE IF EXISTS #{NAME}_#{suffix} WITH (FORCE)")
    end
    conn.exec("DROP ROLE IF EXISTS #{NAME}")
  end
end
