# frozen_string_literal: true

require_relative "../test_helper"
require "neverblock/server"
require "net/http"
require "vips"
require_relative "../../examples/thumbnails/thumbnails"

# Images made with libvips for the tests: an RGB gradient of `width` x
# `height` (with an alpha band when `alpha`), encoded by the suffix's saver.
module ThumbnailImages
  module_function

  def make(width, height, suffix, alpha: false, **options)
    xy = Vips::Image.xyz(width, height)
    x = xy[0]
    y = xy[1]
    image = [x % 256, y % 256, (x + y) % 256]
    image << ((x * 0) + 200) if alpha
    image[0].bandjoin(image[1..]).cast(:uchar).write_to_buffer(suffix, **options)
  end

  # The origin's objects (made once, before any test's event loop runs).
  OBJECTS = {
    "photos/cat.jpg" => make(800, 600, ".jpg"),
    "logo.png" => make(640, 480, ".png", alpha: true),
    "gated.jpg" => make(400, 400, ".jpg"),
    "slow.jpg" => make(40, 40, ".jpg"),
    "notes.jpg" => "these are notes, not an image\n"
  }.freeze

  # @return [Array(Integer, Integer, Integer)] width, height, bands of an encoded image.
  def info(bytes)
    image = Vips::Image.new_from_buffer(bytes, "")
    [image.width, image.height, image.bands]
  end
end

# examples/thumbnails in this test's event loop: an origin (a
# NeverBlock::Server standing in for S3, counting the requests it gets),
# the thumbnail app on a NeverBlock::Server of its own, and the clients,
# all on one loop. Counts are server-side: the origin's requests, the
# resizer's resizes.
class ThumbnailsExampleTest < NeverBlockTest
  # Seconds the app gives the origin; the slow object takes SLOW_ORIGIN.
  ORIGIN_TIMEOUT = 0.5
  SLOW_ORIGIN = 3

  neverblock_timeout 30

  def setup
    @origin_requests = Hash.new(0) # path => requests the origin got
    @gate = Thread::Queue.new      # gated.jpg answers once this is closed
    @objects = ThumbnailImages::OBJECTS.dup
    @servers = []
    origin_port = start_server(method(:origin))
    @app = Thumbnails::App.new(
      origin: Thumbnails::Origin.new("http://127.0.0.1:#{origin_port}/bucket", timeout: ORIGIN_TIMEOUT, concurrency: 4),
      resizer: Thumbnails::Resizer.new(concurrency: 2), cache_bytes: 1024 * 1024, max_size: 2000, max_age: 3600
    )
    @server, @port = start_server(@app, return_server: true)
  end

  def teardown
    @gate.close
    @app&.close
    @servers.each { |server, _| server.stop }
    @servers.each { |_, task| task.value }
    super
  end

  def test_a_thumbnail_fits_within_the_box_in_the_format_of_the_key
    response = get("/thumb/200x200/photos/cat.jpg")
    assert_equal "200", response.code, response.body
    assert_equal "image/jpeg", response["content-type"]
    assert_equal [200, 150, 3], ThumbnailImages.info(response.body), "800x600 scaled to fit 200x200"
    assert response.body.start_with?("\xFF\xD8\xFF".b), "JPEG bytes"
    assert_equal response.body.bytesize.to_s, response["content-length"]
    assert_match(/\A"\h{32}"\z/, response["etag"])
    assert_equal "public, max-age=3600", response["cache-control"]
    assert_equal "miss", response["x-cache"]

    png = get("/thumb/100x100/logo.png")
    assert_equal "200", png.code, png.body
    assert_equal "image/png", png["content-type"]
    assert_equal [100, 75, 4], ThumbnailImages.info(png.body), "640x480 with alpha scaled to fit 100x100"
  end

  def test_a_thumbnail_is_never_scaled_up
    response = get("/thumb/2000x2000/photos/cat.jpg")
    assert_equal [800, 600, 3], ThumbnailImages.info(response.body)
  end

  def test_twenty_concurrent_identical_requests_make_one_origin_fetch_and_one_resize
    requests = Array.new(20) { NeverBlock.spawn { get("/thumb/120x120/gated.jpg") } }
    # The origin holds gated.jpg until all twenty are inside the app.
    wait_until { @server.stats[:requests_in_flight] == 20 }
    assert_equal 1, @origin_requests["/bucket/gated.jpg"], "one fetch while twenty requests wait"
    @gate.close
    responses = NeverBlock.wait_all(requests)

    assert_equal ["200"], responses.map(&:code).uniq
    assert_equal 1, responses.map(&:body).uniq.size
    assert_equal [120, 120, 3], ThumbnailImages.info(responses.first.body)
    assert_equal({ "miss" => 1, "coalesced" => 19 }, responses.map { |r| r["x-cache"] }.tally)
    assert_equal 1, @origin_requests["/bucket/gated.jpg"]
    assert_equal 1, @app.resizer.resizes
    assert_equal 0, @app.stats[:in_flight]
  end

  def test_a_second_request_is_answered_from_memory_and_a_matching_etag_gets_304
    first = get("/thumb/300x300/photos/cat.jpg")
    second = get("/thumb/300x300/photos/cat.jpg")
    assert_equal %w[miss hit], [first["x-cache"], second["x-cache"]]
    assert_equal first.body, second.body
    assert_equal first["etag"], second["etag"]
    assert_equal 1, @origin_requests["/bucket/photos/cat.jpg"], "the second request did not reach the origin"
    assert_equal 1, @app.resizer.resizes

    unchanged = get("/thumb/300x300/photos/cat.jpg", "If-None-Match" => %(W/"other", #{first['etag']}))
    assert_equal "304", unchanged.code
    assert_nil unchanged.body
    assert_equal first["etag"], unchanged["etag"]
    assert_equal "200", get("/thumb/300x300/photos/cat.jpg", "If-None-Match" => %("other")).code

    other_size = get("/thumb/64x64/photos/cat.jpg")
    assert_equal "miss", other_size["x-cache"], "another size is another thumbnail"
    assert_equal 2, @origin_requests["/bucket/photos/cat.jpg"]
  end

  def test_bad_sizes_and_keys_get_400_without_asking_the_origin
    paths = %w[/thumb/2001x10/logo.png /thumb/10x2001/logo.png /thumb/0x10/logo.png /thumb/10x/logo.png
               /thumb/axb/logo.png /thumb/10x10x10/logo.png /thumb/-5x10/logo.png /thumb/10x10/logo.gif
               /thumb/10x10/logo /thumb/10x10/../secret.png /thumb/10x10/.hidden.png /thumb/10x10/a%20b.png]
    paths.each do |path|
      response = get(path)
      assert_equal "400", response.code, "#{path}: #{response.body}"
    end
    assert_empty @origin_requests
    post = Net::HTTP::Post.new("/thumb/10x10/logo.png", "content-type" => "text/plain")
    post.body = ""
    assert_equal "405", request(post).code
    assert_equal "404", get("/elsewhere").code
  end

  def test_a_key_the_origin_does_not_have_gets_404_and_is_not_cached
    2.times do
      response = get("/thumb/100x100/photos/dog.jpg")
      assert_equal "404", response.code
      assert_match(%r{no /bucket/photos/dog\.jpg}, response.body)
    end
    assert_equal 2, @origin_requests["/bucket/photos/dog.jpg"]
  end

  def test_a_slow_origin_gets_504_within_the_timeout
    response = nil
    seconds = elapsed { response = get("/thumb/100x100/slow.jpg") }
    assert_equal "504", response.code, response.body
    assert_operator seconds, :>=, ORIGIN_TIMEOUT * 0.9
    assert_operator seconds, :<, SLOW_ORIGIN / 2.0, "answered at the #{ORIGIN_TIMEOUT} s timeout, not after the origin's #{SLOW_ORIGIN} s"
    assert_equal 0, @app.origin.stats[:in_use]
  end

  def test_an_origin_object_that_is_not_an_image_gets_502
    response = get("/thumb/100x100/notes.jpg")
    assert_equal "502", response.code
    assert_match(/libvips cannot read the original/, response.body)
  end

  # An interlaced 6000x6000 PNG takes libvips half a second or more to
  # decode and scale (it is decoded whole before scaling). A task on the
  # same loop that ticks every 10 ms goes on ticking meanwhile: the resize
  # runs on the thread pool. (Done in the request's fiber, it stops the
  # ticks for the whole resize, and this test fails.) A machine busy with
  # other work can stop the whole process for a while too, so the request
  # is tried up to three times: a held loop fails every one.
  def test_resizes_run_off_the_event_loop
    @objects["big.png"] = NeverBlock.defer { self.class.big_png }
    tries = Array.new(3) do |index|
      took, longest = resize_beside_a_ticker("/thumb/#{300 + index}x#{300 + index}/big.png", 300 + index)
      # 0.1 s is ten ticks: enough to see a held loop (0.19 s under YJIT here).
      assert_operator took, :>, 0.1, "the resize must take long enough to tell (#{took.round(3)} s)"
      break [] if longest < took / 3

      "the ticker stopped for #{longest.round(3)} s of a #{took.round(3)} s request"
    end
    assert_empty tries.compact, "the loop was held"
  end

  def test_the_cache_keeps_the_most_recently_used_within_its_bytes
    cache = Thumbnails::LruCache.new(max_bytes: 100)
    assert cache.store("a", :a, 40)
    assert cache.store("b", :b, 40)
    assert_equal :a, cache["a"] # a is now the most recently used
    assert cache.store("c", :c, 40)
    assert_nil cache["b"], "the least recently used went first"
    assert_equal [:a, :c], [cache["a"], cache["c"]]
    assert_equal 80, cache.bytes
    refute cache.store("huge", :huge, 101), "larger than the whole cache: not kept"
    assert_equal 2, cache.size
  end

  # The big original (5 MB), made once: about a second of libvips.
  def self.big_png
    @big_png ||= ThumbnailImages.make(6000, 6000, ".png", compression: 1, interlace: true)
  end

  private

  # Fetches a resize of `big.png` while a task on the same loop ticks every
  # 10 ms: the request's seconds and the longest gap between ticks.
  def resize_beside_a_ticker(path, side)
    ticks = []
    ticker = NeverBlock.spawn do
      loop do
        ticks << now
        sleep 0.01
      end
    end
    started = now
    response = get(path)
    finished = now
    ticker.cancel
    ticker.wait
    assert_equal "200", response.code, response.body
    assert_equal [side, side, 3], ThumbnailImages.info(response.body)
    gaps = [started, *ticks.select { |tick| tick > started && tick < finished }, finished].each_cons(2).map { |a, b| b - a }
    [finished - started, gaps.max]
  end

  def get(path, headers = {})
    request(Net::HTTP::Get.new(path, headers))
  end

  def request(request)
    Net::HTTP.start("127.0.0.1", @port, read_timeout: 20) { |http| http.request(request) }
  end

  # Waits, polling, for the condition (the test's timeout bounds it).
  def wait_until
    sleep 0.005 until yield
  end

  # The S3 stand-in: objects under /bucket/, 404 for the rest; slow.jpg
  # takes SLOW_ORIGIN seconds, gated.jpg waits for the test's gate.
  def origin(env)
    path = env["PATH_INFO"]
    @origin_requests[path] += 1
    key = path.delete_prefix("/bucket/")
    sleep SLOW_ORIGIN if key == "slow.jpg"
    @gate.pop if key == "gated.jpg"
    body = @objects[key] or return [404, { "content-type" => "application/xml" }, ["<Error><Code>NoSuchKey</Code></Error>"]]

    [200, { "content-type" => "application/octet-stream", "content-length" => body.bytesize.to_s }, [body]]
  end

  # A NeverBlock::Server on 127.0.0.1, a task on this test's loop.
  # @return [Integer, Array(NeverBlock::Server, Integer)] its port (and the server).
  def start_server(app, return_server: false)
    server = NeverBlock::Server.new(app, bind: ["tcp://127.0.0.1:0"], workers: 0, shutdown_timeout: 1)
    port = Integer(server.bound_addresses.first[/\d+\z/])
    @servers << [server, NeverBlock.spawn { server.run }]
    return_server ? [server, port] : port
  end
end

# `neverblock serve examples/thumbnails/config.ru`, as the README runs it:
# a child process, its origin a server in this process.
class ThumbnailsServeTest < PlainTest
  include ServerProcess

  def setup
    @origin = NeverBlock::Server.new(lambda { |env|
      body = ThumbnailImages::OBJECTS[env["PATH_INFO"].delete_prefix("/")]
      body ? [200, {}, [body]] : [404, {}, ["no such key"]]
    }, bind: ["tcp://127.0.0.1:0"], workers: 0, shutdown_timeout: 1)
    @origin_port = Integer(@origin.bound_addresses.first[/\d+\z/])
    @origin_thread = Thread.new { @origin.run }
  end

  def teardown
    super
    @origin.stop
    @origin_thread.join(20)
  end

  def test_neverblock_serve_runs_the_example
    port = free_port
    start(RbConfig.ruby, "exe/neverblock", "serve", "examples/thumbnails/config.ru", "-b", "tcp://127.0.0.1:#{port}",
          "-w", "1", chdir: File.expand_path("../..", __dir__),
          env: { "ORIGIN_URL" => "http://127.0.0.1:#{@origin_port}", "ORIGIN_TIMEOUT" => "2" })
    assert_equal "200", wait_for_answer(port, "/stats").code

    thumbnails = Array.new(2) do
      Net::HTTP.start("127.0.0.1", port) { |http| http.get("/thumb/160x160/photos/cat.jpg") }
    end
    assert_equal %w[200 200], thumbnails.map(&:code), thumbnails.first.body
    assert_equal %w[miss hit], thumbnails.map { |response| response["x-cache"] }
    assert_equal [160, 120, 3], ThumbnailImages.info(thumbnails.last.body)
    stats = JSON.parse(Net::HTTP.get(URI("http://127.0.0.1:#{port}/stats")))
    assert_equal 1, stats["origin_fetches"]
    assert_equal 1, stats["resizes"]

    assert stop_and_wait("TERM").success?, output
  end
end
